"""The grammar engine under the sampler: which schema keywords it enforces (measured on this
install), the compile cache and its time bound, and the engine keeping the constraint through
preemption, `ignore_eos`, min_tokens and seeded sampling."""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading

import pytest

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")

from backends.base import SamplingParams, StructuredOutput  # noqa: E402
from backends.torch_llm.structured.compiler import GrammarCompiler  # noqa: E402
from backends.torch_llm.structured.schema import FORMATS, GrammarError, check_schema  # noqa: E402
from backends.torch_llm.tokenizer import TextTokenizer  # noqa: E402
from tests.backends.torch_llm.conftest import engine_for  # noqa: E402

#: (schema, an instance it accepts, one it refuses): every keyword `check_schema` lets through must
#: be enforced by the grammar engine, or a constrained answer could break its schema unnoticed
ENFORCED = [
    ({"type": "integer", "multipleOf": 3}, "6", "4"),
    ({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    ({"type": "number", "minimum": 1.5, "maximum": 2.5}, "2", "3"),
    ({"type": "number", "exclusiveMaximum": 3}, "2.5", "3"),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', '"a"'),
    ({"type": "string", "pattern": "^[a-c]+$"}, '"ab"', '"ad"'),
    ({"enum": ["x", 1]}, "1", "2"),
    ({"const": "x"}, '"x"', '"y"'),
    ({"type": ["string", "null"]}, "null", "1"),
    ({"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 5}]}, "6", "4"),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, '"ab"', "true"),
    ({"allOf": [{"type": "string", "minLength": 2}]}, '"ab"', '"a"'),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A"}, "1", '"a"'),
    ({"definitions": {"A": {"type": "integer"}}, "$ref": "#/definitions/A"}, "1", '"a"'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1, 2]", "[1]"),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, '["a"]', "[1]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False}, '{"a": 1}', '{"b": 1}'),
    ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False}, '{"a": 1}', '{"b": 1}'),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"a": 1}', '{"a": "x"}'),
    ({"type": "object", "minProperties": 1, "additionalProperties": True}, '{"a": 1}', "{}"),
    ({"type": "object", "maxProperties": 1, "additionalProperties": True}, '{"a": 1}', '{"a": 1, "b": 2}'),
    ({"type": "string", "format": "email"}, '"a@b.co"', '"abc"'),
    ({"type": "string", "format": "date"}, '"2020-01-02"', '"abc"'),
    ({"type": "string", "format": "time"}, '"10:00:00Z"', '"abc"'),
    ({"type": "string", "format": "date-time"}, '"2020-01-02T10:00:00Z"', '"abc"'),
    ({"type": "string", "format": "duration"}, '"P1D"', '"x"'),
    ({"type": "string", "format": "ipv4"}, '"1.2.3.4"', '"abc"'),
    ({"type": "string", "format": "ipv6"}, '"::1"', '"x"'),
    ({"type": "string", "format": "hostname"}, '"a.b"', '"a b"'),
    ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', '"abc"'),
    ({"type": "string", "format": "uri"}, '"http://a.b/c"', '"a b"'),
    ({"type": "string", "format": "uri-reference"}, '"a/b"', '"a b"'),
]

#: keywords xgrammar 0.2.8 compiles but does not enforce: refused by name
NOT_ENFORCED = [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 3}}, "if"),
    ({"allOf": [{"type": "string"}, {"minLength": 2}]}, "allOf"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "format": "idn-email"}, "idn-email"),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    ({"properties": {"x": {"type": "object", "nullable": True}}}, "nullable"),
]


def _byte_compiler() -> object:
    vocab = [bytes([i]) for i in range(256)] + [b""]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=257, stop_token_ids=[256])
    return xgr.GrammarCompiler(info, max_threads=1)


@pytest.mark.parametrize(("schema", "good", "bad"), ENFORCED, ids=[json.dumps(s)[:60] for s, _, _ in ENFORCED])
def test_every_keyword_the_check_lets_through_is_enforced(schema: dict, good: str, bad: str) -> None:
    check_schema(schema)
    grammar = _byte_compiler().compile_json_schema(json.dumps(schema), any_whitespace=False)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(b) for b in text.encode()) and matcher.is_completed()

    assert accepts(good) and not accepts(bad)


def test_every_supported_format_is_in_the_enforced_table() -> None:
    tested = {s.get("format") for s, _, _ in ENFORCED}
    assert FORMATS <= tested


@pytest.mark.parametrize(("schema", "keyword"), NOT_ENFORCED, ids=[k for _, k in NOT_ENFORCED])
def test_keywords_the_engine_would_not_enforce_are_refused_by_name(schema: dict, keyword: str) -> None:
    with pytest.raises(GrammarError, match=f"`{keyword}`|{keyword!r}"):
        check_schema(schema)


def test_nested_refusal_names_where_the_keyword_is() -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(GrammarError, match=r"\$\.properties\.tags\.uniqueItems"):
        check_schema(schema)


@pytest.fixture(scope="module")
def engine(llama_dir: pathlib.Path):  # type: ignore[no-untyped-def]
    return engine_for(llama_dir)


@pytest.fixture(scope="module")
def compiler(engine, llama_dir: pathlib.Path) -> GrammarCompiler:  # type: ignore[no-untyped-def]
    return GrammarCompiler(TextTokenizer(llama_dir), engine.config.vocab_size, engine.config.eos_token_ids)


def _run(engine, requests: dict[str, tuple[SamplingParams, object]]) -> dict[str, tuple[list[int], str, str]]:  # type: ignore[no-untyped-def]
    out: dict[str, list] = {rid: [[], "", None] for rid in requests}
    for rid, (params, grammar) in requests.items():
        engine.add_request(rid, [0, 11, 12, 13], params, grammar=grammar)
    while engine.has_unfinished:
        for o in engine.step():
            entry = out[o.request_id]
            entry[0] += o.token_ids
            entry[1] += o.text
            entry[2] = o.finish_reason or entry[2]
    return {rid: (v[0], v[1], v[2]) for rid, v in out.items()}


def test_strings_with_length_bounds_never_hold_control_characters(engine, compiler) -> None:  # type: ignore[no-untyped-def]
    """xgrammar 0.2.8's rule for a string with maxLength admits raw control bytes; JSON grammars
    compile against a vocabulary without them (this failed before: `"loǳ 1 m\\x04"`)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 30}}, "required": ["s"]}
    so = StructuredOutput(json_schema=json.dumps(schema, sort_keys=True))
    grammar = asyncio.run(compiler.get(so))
    reqs = {str(i): (SamplingParams(max_tokens=60, temperature=1.5, seed=i, structured=so), grammar) for i in range(12)}
    results = _run(engine, reqs)
    stopped = [text for _, text, reason in results.values() if reason == "stop"]
    assert stopped
    for text in stopped:
        assert isinstance(json.loads(text)["s"], str)


def test_preemption_and_batch_company_do_not_change_a_seeded_constrained_answer(llama_dir, compiler) -> None:  # type: ignore[no-untyped-def]
    """A preempted sequence keeps its matcher (its sampled tokens are replayed as prompt, never
    re-drawn), so its answer is token-identical to the same request run alone."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 12}
    so = StructuredOutput(json_schema=json.dumps(schema, sort_keys=True))
    alone_engine = engine_for(llama_dir)
    grammar = asyncio.run(compiler.get(so))

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured=so)

    alone = {str(i): _run(alone_engine, {str(i): (params(i), grammar)})[str(i)] for i in range(6)}
    tight = engine_for(llama_dir, num_kv_blocks=10, block_size=4, enable_prefix_caching=False)
    together = _run(tight, {str(i): (params(i), grammar) for i in range(6)})
    assert tight.scheduler.num_preemptions > 0
    assert together == alone
    for _, text, reason in together.values():
        if reason == "stop":
            json.loads(text)


def test_ignore_eos_ends_when_the_grammar_completes(engine, compiler) -> None:  # type: ignore[no-untyped-def]
    so = StructuredOutput(choice=("yes", "no"))
    grammar = asyncio.run(compiler.get(so))
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1, ignore_eos=True, structured=so)
    _, text, reason = _run(engine, {"a": (params, grammar)})["a"]
    assert text in ("yes", "no") and reason == "stop"


def test_min_tokens_never_pushes_the_output_past_its_grammar(engine, compiler) -> None:  # type: ignore[no-untyped-def]
    """min_tokens forbids the end of sequence, the complete grammar allows nothing else: the
    grammar wins and the answer ends valid."""
    so = StructuredOutput(choice=("ok",))
    grammar = asyncio.run(compiler.get(so))
    params = SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, structured=so)
    _, text, reason = _run(engine, {"a": (params, grammar)})["a"]
    assert (text, reason) == ("ok", "stop")


def test_a_structured_request_needs_its_grammar(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="compiled grammar"):
        engine.add_request("x", [0, 1], SamplingParams(structured=StructuredOutput(regex="a")))


def test_compiles_are_cached_shared_and_bounded_in_time(llama_dir, engine) -> None:  # type: ignore[no-untyped-def]
    tok = TextTokenizer(llama_dir)
    compiler = GrammarCompiler(tok, engine.config.vocab_size, engine.config.eos_token_ids, cache_size=2)

    async def scenario() -> None:
        a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
        first, again = await asyncio.gather(compiler.get(a), compiler.get(a))
        assert first is again  # one compile for concurrent requests with one constraint
        assert await compiler.get(a) is first  # a hit: the same compiled object (a compile makes a new one)
        await compiler.get(b)
        await compiler.get(c)  # least recently used (a) out
        assert compiler.cached(a) is None and compiler.cached(c) is not None
        with pytest.raises(GrammarError, match="does not compile"):
            await compiler.get(StructuredOutput(grammar="root ::= ("))
        # the one compile thread is held busy, so the next compile cannot land within its bound
        # (a tiny bound alone races a sub-millisecond compile, and the compile can win)
        busy = threading.Event()
        compiler._pool.submit(busy.wait, 30)
        compiler.timeout_s = 0.05
        try:
            with pytest.raises(GrammarError, match="did not compile within"):
                await compiler.get(StructuredOutput(regex="[0-9]{1,40}"))
        finally:
            busy.set()

    asyncio.run(scenario())
    compiler.close()


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        ("ipv4", "10.0.255.1", "056.45.53.6"),
        ("date", "2024-02-29", "2642-02-31"),
        ("date", "2000-02-29", "1900-02-29"),
        ("time", "23:59:59.25Z", "15:36:124Z"),
        ("time", "00:00:00+01:00", "00:32:60Z"),
        ("date-time", "2020-01-02T10:00:00.5-03:30", "1416-03-20T09:07:60Z"),
    ],
)
def test_formats_looser_in_xgrammar_compile_to_strict_patterns(fmt: str, good: str, bad: str) -> None:
    """xgrammar 0.2.8 took each `bad` (found by validating sampled answers with jsonschema's
    format checker); the pattern compiled in its place does not."""
    from backends.torch_llm.structured.schema import strict_formats

    schema = json.dumps(strict_formats({"type": "string", "format": fmt}))
    grammar = _byte_compiler().compile_json_schema(schema, any_whitespace=False)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return all(matcher.accept_token(b) for b in json.dumps(text).encode()) and matcher.is_completed()

    assert accepts(good) and not accepts(bad)
