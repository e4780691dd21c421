"""Which JSON Schema keywords the grammar engine enforces, checked before a schema is compiled.

xgrammar compiles a schema with keywords it does not implement (`not`, `uniqueItems`, `if`, an
unknown `format`...) without a word and then lets outputs through that break them. A constraint the
engine would not keep must be refused instead, naming the keyword, so the caller can drop it or use
another deployment. The sets below were measured against xgrammar 0.2.8 (each keyword accepted
here rejects a violating instance: tests/torch_llm/test_grammar.py checks that on every install).
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
