"""Compiling a `StructuredOutput` into a token grammar (xgrammar), and the cache of compiled ones.

Compiling runs on worker threads, never on the event loop nor the engine thread, bounded in time:
a schema that does not compile in `timeout_s` is refused (400) while the others keep streaming.

The vocabulary handed to xgrammar is each token's raw bytes (`TextTokenizer.token_bytes`), so any
tokenizer works the same way; special tokens are given no text, so the grammar never lets a
`</s>` or `<|im_end|>` stand inside a JSON string, and only the end-of-sequence ids may end it.
JSON grammars get a second vocabulary in which tokens holding a control byte (0x00-0x1f) have no
text either: compact JSON never holds one raw, and xgrammar 0.2.8's rule for strings with
`minLength`/`maxLength` lets them through (`"a\x04"` would not parse).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import os
import threading
import time
from collections import OrderedDict
from typing import Any

import structlog

from backends.base import StructuredOutput
from backends.errors import InvalidInput
from backends.torch_llm.structured.grammar import STRUCTURED_FIELDS, CompiledGrammar
from backends.torch_llm.structured.schema import GrammarError, check_schema, strict_formats

log = structlog.get_logger(__name__)

__all__ = ["STRUCTURED_FIELDS", "GrammarCompiler", "GrammarError"]


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; an LRU cache of compiled grammars.

    Args:
        tokenizer: the model's tokenizer (`token_bytes`, `special_ids`).
        vocab_size: the model's vocabulary (the logits' width; may exceed the tokenizer's).
        stop_ids: the model's end-of-sequence ids.
        cache_size: compiled grammars kept (least recently used out).
        timeout_s: longest a compile may take before the request is refused.
        threads: compile worker threads (one compile may also use several inside xgrammar).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: frozenset[int],
        *,
        cache_size: int = 128,
        timeout_s: float = 10.0,
        threads: int = 1,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = stop_ids
        self._cache_size = cache_size
        self.timeout_s = timeout_s
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        #: compiles under way, so concurrent requests with one schema share one compile
        self._pending: dict[StructuredOutput, concurrent.futures.Future[CompiledGrammar]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="grammar", initializer=_yield_to_serving
        )
        self._lock = threading.Lock()
        #: xgrammar compilers, built by the first compile that needs one: JSON (no control
        #: bytes) or any text
        self._compilers: dict[bool, Any] = {}
        self._raw_vocab: list[bytes] | None = None

    def warm(self) -> None:
        """Import xgrammar and build the vocabulary tables now, at load (a second or more on a 32k
        vocabulary, which a first request's compile and its time bound should not pay), when
        xgrammar is installed."""
        if importlib.util.find_spec("xgrammar") is None:
            return
        try:
            self._xgr_compiler(True)
            self._xgr_compiler(False)
        except Exception as exc:  # noqa: BLE001 - free text still serves; constrained requests say why
            log.warning("grammar_warm_failed", error=f"{type(exc).__name__}: {exc}")

    async def for_request(self, structured: StructuredOutput | None) -> CompiledGrammar | None:
        """The compiled grammar a request's constraint needs (None for free text).

        Raises:
            InvalidInput: the constraint cannot be enforced here (the message says why).
        """
        if structured is None:
            return None
        if importlib.util.find_spec("xgrammar") is None:
            raise InvalidInput("constrained decoding needs the `xgrammar` package (the `torch` extra)")
        try:
            return await self.get(structured)
        except GrammarError as exc:
            raise InvalidInput(str(exc)) from None

    def cached(self, structured: StructuredOutput) -> CompiledGrammar | None:
        """The compiled grammar if it is in the cache (marks it recently used)."""
        grammar = self._cache.get(structured)
        if grammar is not None:
            self._cache.move_to_end(structured)
        return grammar

    async def get(self, structured: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `structured`: from the cache, or compiled off the event loop.

        Raises:
            GrammarError: the constraint is malformed, uses what the engine cannot enforce, or did
                not compile within `timeout_s`.
        """
        hit = self.cached(structured)
        if hit is not None:
            return hit
        future = self._pending.get(structured)
        if future is None:
            future = self._pool.submit(self._compile, structured)
            self._pending[structured] = future
            loop = asyncio.get_running_loop()
            # lands on the loop thread (the cache's only user), even when every waiter gave up
            future.add_done_callback(lambda f: _post(loop, self._landed, structured, f))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"the output constraint did not compile within {self.timeout_s:g} s (schema too "
                "complex); simplify it"
            ) from None

    def _landed(self, structured: StructuredOutput, future: concurrent.futures.Future[CompiledGrammar]) -> None:
        if self._pending.get(structured) is future:
            del self._pending[structured]
        if future.cancelled() or future.exception() is not None:
            return
        self._cache[structured] = future.result()
        self._cache.move_to_end(structured)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- worker threads ------------------------------------------------------------------------

    def _compile(self, structured: StructuredOutput) -> CompiledGrammar:
        started = time.perf_counter()
        json_kind = structured.json_schema is not None or structured.json_object
        compiler = self._xgr_compiler(json_kind)
        try:
            compiled = _compile_with(compiler, structured)
        except GrammarError:
            raise
        except (RuntimeError, ValueError) as exc:  # xgrammar's parse errors: the caller's input
            raise GrammarError(f"the output constraint does not compile: {_first_line(exc)}") from None
        log.info("grammar_compiled", kind=_kind(structured), ms=round((time.perf_counter() - started) * 1e3, 2))
        return CompiledGrammar(compiled, self._vocab_size)

    def _xgr_compiler(self, json_kind: bool) -> Any:
        with self._lock:
            compiler = self._compilers.get(json_kind)
            if compiler is None:
                import xgrammar as xgr

                vocab = self._vocab()
                if json_kind:
                    vocab = [b"" if any(b < 0x20 for b in t) else t for t in vocab]
                info = xgr.TokenizerInfo(
                    vocab, xgr.VocabType.RAW, vocab_size=self._vocab_size, stop_token_ids=sorted(self._stop_ids)
                )
                # xgrammar's own cache is off: this class keeps the compiled grammars (one policy)
                compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._compilers[json_kind] = compiler
            return compiler


    def _vocab(self) -> list[bytes]:
        """Each token's raw bytes (special tokens: none), built once."""
        if self._raw_vocab is None:
            tok = self._tokenizer
            special = tok.special_ids
            n = min(tok.vocab_size, self._vocab_size)
            self._raw_vocab = [b"" if i in special else tok.token_bytes(i) for i in range(n)]
        return self._raw_vocab


def _yield_to_serving() -> None:
    """Lower this compile thread's priority (Linux: niceness is per thread): on a machine with few
    cores a long compile then takes CPU the engine thread and the event loop leave, instead of
    slowing every running stream."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at normal priority
        pass


def _post(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is waiting for this compile any more
        pass


def _compile_with(compiler: Any, s: StructuredOutput) -> Any:
    """One xgrammar compile for the one field of `s` that is set."""
    if s.json_schema is not None:
        try:
            schema = json.loads(s.json_schema)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        check_schema(schema)
        # compact separators: one way to write each value, so a model cannot wander in whitespace
        text = json.dumps(strict_formats(schema))
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if s.json_object:
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if s.regex is not None:
        return compiler.compile_regex(s.regex)
    if s.choice is not None:
        if not s.choice:
            raise GrammarError("`choice` needs at least one string")
        alternatives = " | ".join(_ebnf_literal(c) for c in s.choice)
        return compiler.compile_grammar(f"root ::= {alternatives}")
    if s.grammar is not None:
        return compiler.compile_grammar(s.grammar)
    raise GrammarError("the output constraint sets none of json_schema, json_object, regex, choice, grammar")


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes are a subset of what xgrammar reads)."""
    if not text:
        return '""'
    return json.dumps(text, ensure_ascii=False)


def _kind(s: StructuredOutput) -> str:
    for name in ("json_schema", "regex", "choice", "grammar"):
        if getattr(s, name) is not None:
            return name
    return "json_object" if s.json_object else "none"


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split("] ", 1)[-1] if text.startswith("[") else text
