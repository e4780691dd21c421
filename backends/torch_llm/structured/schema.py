"""Which JSON Schema keywords the grammar engine enforces, checked before a schema is compiled.

xgrammar compiles a schema with keywords it does not implement (`not`, `uniqueItems`, `if`, an
unknown `format`...) without a word and then lets outputs through that break them. A constraint the
engine would not keep must be refused instead, naming the keyword, so the caller can drop it or use
another deployment. The sets below were measured against xgrammar 0.2.8 (each keyword accepted
here rejects a violating instance: tests/backends/torch_llm/test_grammar.py checks that on every install).
"""

from __future__ import annotations

from typing import Any


class GrammarError(ValueError):
    """The constraint cannot be compiled or enforced; the message is meant for the caller (a 400)."""


#: keywords whose subschemas the walk follows, by shape: one schema, a map of them, a list of them
_ONE = frozenset({"additionalProperties", "items", "unevaluatedProperties"})
_MAP = frozenset({"properties", "$defs", "definitions"})
_LIST = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
#: keywords enforced on their own values (no subschemas)
_VALUES = frozenset(
    {
        "type", "enum", "const", "required", "$ref",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "minLength", "maxLength", "pattern", "format",
        "minItems", "maxItems", "minProperties", "maxProperties",
    }
)  # fmt: skip
#: annotations: they describe, they constrain nothing
_ANNOTATIONS = frozenset(
    {
        "title", "description", "default", "examples", "example", "$schema", "$id", "$comment",
        "deprecated", "readOnly", "writeOnly", "discriminator", "strict",
    }
)  # fmt: skip
#: `format` values the engine enforces
FORMATS = frozenset(
    {
        "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
        "uri", "uri-reference",
    }
)  # fmt: skip


def check_schema(schema: Any, path: str = "$") -> None:
    """Refuse a schema that uses a keyword the grammar engine would not enforce.

    Raises:
        GrammarError: naming the keyword and where it is (`... at $.properties.tags`).
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__} at {path}")
    for key, value in schema.items():
        where = f"{path}.{key}"
        if key in _ANNOTATIONS:
            continue
        if key in _VALUES:
            _check_value(key, value, where)
        elif key in _ONE:
            _check_one(key, value, where)
        elif key in _MAP:
            if not isinstance(value, dict):
                raise GrammarError(f"`{key}` must be an object at {where}")
            for name, sub in value.items():
                check_schema(sub, f"{where}.{name}")
        elif key in _LIST:
            _check_list(key, value, where)
        else:
            raise GrammarError(
                f"the JSON schema keyword `{key}` (at {where}) is not supported by this engine's "
                "constrained decoding; remove it or use a deployment that enforces it"
            )


def _check_value(key: str, value: Any, where: str) -> None:
    if key == "format" and value not in FORMATS:
        raise GrammarError(
            f"the JSON schema `format` {value!r} (at {where}) is not supported by this engine's "
            f"constrained decoding; supported: {', '.join(sorted(FORMATS))}"
        )
    if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
        raise GrammarError(f"`$ref` {value!r} (at {where}) must point inside the schema (`#/$defs/...`)")


def _check_one(key: str, value: Any, where: str) -> None:
    if key == "items" and isinstance(value, list):
        raise GrammarError(f"`items` as a list (at {where}) is not supported: use `prefixItems`")
    if key == "unevaluatedProperties" and value is not False:
        raise GrammarError(f"`unevaluatedProperties` (at {where}) is supported only as false")
    check_schema(value, where)


def _check_list(key: str, value: Any, where: str) -> None:
    if not isinstance(value, list) or not value:
        raise GrammarError(f"`{key}` must be a non-empty list at {where}")
    if key == "allOf" and len(value) > 1:  # one entry is that schema; an intersection is not built
        raise GrammarError(
            f"the JSON schema keyword `allOf` with {len(value)} schemas (at {where}) is not supported "
            "by this engine's constrained decoding; merge them into one schema"
        )
    for i, sub in enumerate(value):
        check_schema(sub, f"{where}[{i}]")


_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_YEAR = r"([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001..9999 (no year 0)
_LEAP = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
_DATE = (
    rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
    rf"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP}-02-29)"
)
# the fraction is unrolled: xgrammar 0.2.8 reads `(\.[0-9]{1,6})?` in a JSON string as if the dot
# were optional too (it took "15:36:124Z")
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9][0-9]?[0-9]?[0-9]?[0-9]?[0-9]?)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
#: formats whose xgrammar rule is looser than RFC 3339 / RFC 2673 (it took "2642-02-31", a
#: seconds field of 60, "056.45.53.6"), as the stricter patterns compiled in their place
STRICT_FORMATS = {
    "ipv4": rf"^{_OCTET}(\.{_OCTET}){{3}}$",
    "date": rf"^{_DATE}$",
    "time": rf"^{_TIME}$",
    "date-time": rf"^{_DATE}T{_TIME}$",
}


def strict_formats(schema: Any) -> Any:
    """`schema` with each `format` of `STRICT_FORMATS` replaced by its pattern (a copy; nodes that
    already have a `pattern` keep their format)."""
    if isinstance(schema, list):
        return [strict_formats(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_formats(v) for k, v in schema.items()}
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt in STRICT_FORMATS and "pattern" not in schema:
        del out["format"]
        out["pattern"] = STRICT_FORMATS[fmt]
    return out
