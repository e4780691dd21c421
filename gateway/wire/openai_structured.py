"""The output constraint of an OpenAI-style request, as one `StructuredOutput`.

Clients ask for structured output in three dialects: OpenAI's `response_format` (`json_object`, or
`json_schema` with `{name, schema, strict}`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`) and vLLM's older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. All map to `SamplingParams.structured`, which an engine with
constrained decoding enforces; the fields themselves also travel in `GenerateRequest.extra`, so a
remote upstream receives them exactly as sent. A request may set one constraint: two (say a
`response_format` schema and a `guided_regex`) are a 400. A constraint shape this module does not
know (vLLM's `structural_tag`) maps to nothing here: an engine refuses the field by name, a remote
upstream gets it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from backends.base import StructuredOutput
from backends.errors import InvalidInput

#: vLLM's older per-kind fields -> the `structured_outputs` key each one is
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_output(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> StructuredOutput | None:
    """The one constraint these request fields ask for (None: free text, or a shape left to the
    backend to honour or refuse by name).

    Args:
        response_format: OpenAI's field, as sent.
        structured_outputs: vLLM's field, as sent.
        guided: vLLM's `guided_*` fields that are set, by name.

    Raises:
        InvalidInput: a malformed constraint, or more than one.
    """
    found: list[tuple[str, StructuredOutput]] = []
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise InvalidInput("`structured_outputs` must be an object")
        keys = [k for k in ("json", "regex", "choice", "grammar") if structured_outputs.get(k) is not None]
        if structured_outputs.get("json_object"):
            keys.append("json_object")
        if len(keys) > 1:
            raise InvalidInput(f"`structured_outputs` sets {_names(keys)}: give one of them")
        if keys:
            found.append(("structured_outputs", _constraint(keys[0], structured_outputs[keys[0]], keys[0])))
    for name, value in guided.items():
        if value is not None:
            found.append((name, _constraint(GUIDED_FIELDS[name], value, name)))
    if len(found) > 1:
        raise InvalidInput(f"{_names([n for n, _ in found])} each set an output constraint: give one")
    return found[0][1] if found else None


def _from_response_format(raw: Any) -> StructuredOutput | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise InvalidInput("`response_format` must be an object with a `type`")
    kind = raw["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        return None  # another dialect's type: the backend honours it or refuses `response_format`
    spec = raw.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidInput("`response_format.json_schema` must be an object with `name` and `schema`")
    if "schema" not in spec:
        raise InvalidInput("`response_format.json_schema.schema` is required (the JSON schema to follow)")
    return _constraint("json", spec["schema"], "response_format.json_schema.schema")


def _constraint(kind: str, value: Any, where: str) -> StructuredOutput:
    """One constraint of `kind` (a `structured_outputs` key) from its value as sent."""
    if kind == "json":
        return StructuredOutput(json_schema=canonical_schema(value, where))
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidInput(f"`{where}` must be a non-empty list of strings")
        return StructuredOutput(choice=tuple(value))
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"`{where}` must be a non-empty string")
    return StructuredOutput(regex=value) if kind == "regex" else StructuredOutput(grammar=value)


def canonical_schema(schema: Any, where: str = "json_schema") -> str:
    """A JSON schema (an object, a boolean, or JSON text of one) as canonical JSON text (sorted
    keys, no spaces): equal schemas give equal text, so they share one compiled grammar.

    Raises:
        InvalidInput: not a schema.
    """
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError:
            raise InvalidInput(f"`{where}` is a string but not JSON") from None
    if not isinstance(schema, dict | bool):
        raise InvalidInput(f"`{where}` must be a JSON schema (an object)")
    return msgspec.json.encode(schema, order="sorted").decode()


def _names(names: list[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return ", ".join(quoted[:-1]) + " and " + quoted[-1] if len(quoted) > 1 else quoted[0]
