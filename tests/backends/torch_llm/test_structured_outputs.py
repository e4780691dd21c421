"""Constrained decoding through the running gateway with the `openai` SDK, on tiny random-weight
models (their garbage text is what makes the constraint visible): JSON schemas whole and streamed
with `n` > 1, regexes, choices, json_object, `beta.chat.completions.parse` with a Pydantic model,
a cut by max_tokens, preemption, a LoRA adapter, the model's own logprobs, and the 400s."""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")
pytest.importorskip("peft")

import jsonschema  # noqa: E402
import pydantic  # noqa: E402
from openai import BadRequestError, OpenAI  # noqa: E402

from gateway.config import parse_config  # noqa: E402
from gateway.http.app import create_app  # noqa: E402
from tests.conftest import ADMIN_HEADERS, create_key  # noqa: E402
from tests.lora_adapters import write_peft_adapter  # noqa: E402
from tests.servers import serve_app  # noqa: E402

MESSAGES = [{"role": "user", "content": "give me the record"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
        "manager": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/ref"}]},
    },
    "required": ["name", "age", "role", "tags", "manager"],
    "additionalProperties": False,
    "$defs": {
        "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "ref": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
    },
}


@pytest.fixture(scope="module")
def gateway(llama_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    adapter = write_peft_adapter(
        llama_dir, tmp_path_factory.mktemp("adapter") / "a", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{acme: {{limits: {{requests_per_minute: 100000}}}}}}
deployments:
  llm: {{backend: torch_llm, model: {llama_dir}, device: cpu, adapters: {{tuned: {adapter}}}}}
  tight:
    backend: torch_llm
    model: {llama_dir}
    device: cpu
    options: {{num_kv_blocks: 12, block_size: 4, max_num_seqs: 6, enable_prefix_caching: false}}
  hurried:
    backend: torch_llm
    model: {llama_dir}
    device: cpu
    options: {{grammar_compile_timeout_s: 0.000001}}
models:
  m: {{routes: [{{deployment: llm}}]}}
  tight: {{routes: [{{deployment: tight}}]}}
  hurried: {{routes: [{{deployment: hurried}}]}}
""",
        base_dir=pathlib.Path("."),
    )
    with serve_app(create_app(config)) as url:
        key = create_key(url, "acme")
        yield {"url": url, "client": OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)}


def _valid(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return value


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_whole_with_n_every_stopped_answer_parses_and_validates(gateway: dict[str, Any]) -> None:
    answer = gateway["client"].chat.completions.create(
        model="m", messages=MESSAGES, response_format=_schema_format(PERSON), n=4, max_tokens=200,
        temperature=1.0, seed=7,
    )  # fmt: skip
    reasons = [c.finish_reason for c in answer.choices]
    assert len(answer.choices) == 4 and "stop" in reasons
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            _valid(choice.message.content, PERSON)
    assert len({c.message.content for c in answer.choices}) > 1, "each choice samples on its own"


def test_json_schema_streamed_with_n(gateway: dict[str, Any]) -> None:
    stream = gateway["client"].chat.completions.create(
        model="m", messages=MESSAGES, response_format=_schema_format(PERSON), n=2, max_tokens=200,
        temperature=1.0, seed=11, stream=True,
    )  # fmt: skip
    texts: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert set(reasons) == {0, 1}
    for index, reason in reasons.items():
        if reason == "stop":
            _valid(texts[index], PERSON)
    assert "stop" in reasons.values()


def test_regex_choice_and_json_object_in_every_dialect(gateway: dict[str, Any]) -> None:
    client = gateway["client"]
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        answer = client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=30, temperature=1.0, seed=1, extra_body=extra
        )
        assert answer.choices[0].finish_reason == "stop"
        assert re.fullmatch(regex, answer.choices[0].message.content)
    options = ["alpha", "beta gamma", "δ-delta"]
    for extra in ({"guided_choice": options}, {"structured_outputs": {"choice": options}}):
        answer = client.completions.create(
            model="m", prompt="pick", max_tokens=20, temperature=1.0, n=3, seed=2, extra_body=extra
        )
        assert all(c.text in options and c.finish_reason == "stop" for c in answer.choices)
    answer = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=3, n=3,
        response_format={"type": "json_object"},
    )  # fmt: skip
    stopped = [c for c in answer.choices if c.finish_reason == "stop"]
    assert all(isinstance(json.loads(c.message.content), dict) for c in stopped)
    grammar = 'root ::= "yes" | "no" | ("maybe " [0-9])'
    answer = client.completions.create(
        model="m", prompt="well", max_tokens=10, temperature=1.0, n=4, seed=4, extra_body={"guided_grammar": grammar}
    )
    assert all(re.fullmatch(r"yes|no|maybe [0-9]", c.text) for c in answer.choices)


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    zip: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Customer(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    tier: int = pydantic.Field(ge=1, le=3)
    address: Address
    note: str | None = pydantic.Field(max_length=8)


def test_the_sdk_parse_helper_with_a_pydantic_model(gateway: dict[str, Any]) -> None:
    parsed = []
    for seed in range(4):
        completion = gateway["client"].beta.chat.completions.parse(
            model="m", messages=MESSAGES, response_format=Customer, max_tokens=150, temperature=1.0, seed=seed
        )
        choice = completion.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(choice.message.parsed, Customer)
            parsed.append(choice.message.parsed)
    assert parsed, "no answer finished within max_tokens"


def test_a_cut_by_max_tokens_ends_with_length(gateway: dict[str, Any]) -> None:
    answer = gateway["client"].chat.completions.create(
        model="m", messages=MESSAGES, response_format=_schema_format(PERSON), max_tokens=5, temperature=1.0
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 5
    assert answer.choices[0].message.content.startswith("{")


def test_logprobs_are_the_models_own_not_the_masked_distribution(gateway: dict[str, Any]) -> None:
    answer = gateway["client"].chat.completions.create(
        model="m", messages=MESSAGES, response_format=_schema_format(PERSON), max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    first = answer.choices[0].logprobs.content[0]
    assert first.token == "{"
    # the grammar forces "{"; renormalised over the one allowed token it would be 0 (probability 1)
    assert first.logprob < -0.5
    assert first.top_logprobs[0].logprob >= first.logprob


def test_preempted_sequences_resume_their_grammar(gateway: dict[str, Any]) -> None:
    """12 blocks of 4 tokens for 6 sequences growing to ~60 tokens each: the engine preempts and
    recomputes; every answer that stops still parses and validates."""
    before = _preemptions(gateway["url"])
    answer = gateway["client"].chat.completions.create(
        model="tight", messages=MESSAGES, response_format=_schema_format(PERSON), n=6, max_tokens=30,
        temperature=1.0, seed=5,
    )  # fmt: skip
    assert _preemptions(gateway["url"]) > before
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            _valid(choice.message.content, PERSON)
        else:
            assert choice.finish_reason == "length"


def test_a_lora_adapter_keeps_the_constraint(gateway: dict[str, Any]) -> None:
    answer = gateway["client"].chat.completions.create(
        model="tuned", messages=MESSAGES, response_format=_schema_format(PERSON), n=3, max_tokens=200,
        temperature=1.0, seed=9, stop=["never-in-json"],
    )  # fmt: skip
    assert "stop" in [c.finish_reason for c in answer.choices]
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            _valid(choice.message.content, PERSON)


def test_unsupported_keywords_conflicts_and_timeouts_are_400s(gateway: dict[str, Any]) -> None:
    client = gateway["client"]
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="m", messages=MESSAGES, response_format=_schema_format(unique))
    assert "`uniqueItems`" in err.value.message and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(
            model="m", messages=MESSAGES, response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}
        )
    assert "`response_format` and `guided_regex`" in err.value.message
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="m", messages=MESSAGES, extra_body={"guided_regex": "(a"})
    assert "does not compile" in err.value.message
    many = {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i + 3}}}-[0-9]{{2}}$"} for i in range(40)}
    slow = {"type": "object", "properties": many, "required": list(many), "additionalProperties": False}
    with pytest.raises(BadRequestError) as err:  # milliseconds of compile against a 1 us bound
        client.chat.completions.create(model="hurried", messages=MESSAGES, response_format=_schema_format(slow))
    assert "did not compile within" in err.value.message
    # a shape this engine does not implement is refused by name, not dropped
    r = httpx.post(
        f"{gateway['url']}/v1/chat/completions",
        headers={"Authorization": f"Bearer {client.api_key}"},
        json={"model": "m", "messages": MESSAGES, "structured_outputs": {"structural_tag": "{}"}},
    )
    assert r.status_code == 400 and "`structured_outputs`" in r.json()["error"]["message"]


def _preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text
    found = re.findall(r'^fleetgate_llm_num_preemptions_total\{deployment="tight"\} ([0-9.e+]+)$', text, re.M)
    return float(found[0]) if found else 0.0


SCHEMAS = {p.stem: json.loads(p.read_text()) for p in sorted((pathlib.Path(__file__).parent / "schemas").glob("*.json"))}


def _answers(client: OpenAI, schema: dict[str, Any], seed: int, stream: bool) -> list[tuple[str, str]]:
    """(text, finish_reason) of each of 2 choices at temperature 1.0, whole or streamed."""
    args = {
        "model": "m", "messages": MESSAGES, "response_format": _schema_format(schema), "n": 2,
        "max_tokens": 160, "temperature": 1.0, "seed": seed,
    }  # fmt: skip
    if not stream:
        answer = client.chat.completions.create(**args)
        return [(c.message.content, c.finish_reason) for c in answer.choices]
    texts, reasons = ["", ""], ["", ""]
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return list(zip(texts, reasons, strict=True))


def test_the_schema_corpus_has_no_invalid_output_whole_or_streamed(gateway: dict[str, Any]) -> None:
    """Over every schema kept in schemas/ (objects, arrays with item bounds, enums, patterns,
    formats, number ranges, $ref/$defs, anyOf, required, additionalProperties: false): at
    temperature 1.0, whole and streamed, n = 2, every answer that ends with "stop" parses and
    validates; the rest end with "length"."""
    from concurrent.futures import ThreadPoolExecutor

    assert len(SCHEMAS) >= 100
    jobs = [(name, i % 2 == 1) for i, name in enumerate(SCHEMAS)]
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda job: _answers(gateway["client"], SCHEMAS[job[0]], len(job[0]), job[1]), jobs)
        )
    invalid, stopped = [], 0
    for (name, _), answers in zip(jobs, results, strict=True):
        for text, reason in answers:
            assert reason in ("stop", "length"), (name, reason)
            if reason != "stop":
                continue
            stopped += 1
            try:
                _valid(text, SCHEMAS[name])
            except (ValueError, jsonschema.ValidationError) as exc:
                invalid.append((name, text, str(exc)[:200]))
    assert invalid == []
    assert stopped >= len(jobs), f"only {stopped} of {2 * len(jobs)} answers finished within max_tokens"


def test_a_stop_string_still_ends_a_constrained_answer(gateway: dict[str, Any]) -> None:
    """The grammar forces "alpha,beta"; the stop string cuts it where it appears, as without one."""
    answer = gateway["client"].completions.create(
        model="m", prompt="x", max_tokens=20, temperature=1.0, stop=[","],
        extra_body={"guided_regex": "alpha,beta"},
    )  # fmt: skip
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("alpha", "stop")
