"""The `torch_llm` backend: the gateway-facing adapter around the async engine.

`create()` is cheap (validates options and the model folder, imports no torch); `load()` builds the
engine in a worker thread; `generate()` streams `TokenEvent`s from the engine thread.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import structlog

from backends.base import (
    Capability,
    GenerateRequest,
    ModelMetadata,
    SamplingParams,
    TensorSpec,
    TokenEvent,
    Usage,
)
from backends.errors import BackendUnavailable, InvalidInput, ModelNotFound
from backends.spec import DeploymentSpec
from backends.tool_parsers import default_parser
from backends.tool_parsers.plan import plan_tools
from backends.torch_llm.model.config import ModelConfig, read_sampling_defaults, with_model_defaults
from backends.torch_llm.options import LLMOptions, decode_options
from backends.torch_llm.requests import (
    FAILED,
    check_sampling,
    check_supported,
    check_token_biases,
    failure,
    fingerprint,
    token_logprobs,
    tokenize,
)
from backends.torch_llm.structured.compiler import GrammarCompiler

if TYPE_CHECKING:
    from backends.torch_llm.async_engine import AsyncLLMEngine
    from backends.torch_llm.factory import EngineParts
    from backends.torch_llm.scheduler import WaitingQueue

log = structlog.get_logger(__name__)

#: prompt tokens kept, over all counted prompts waiting for their `generate` call
_MAX_TOKENIZED_TOKENS = 1 << 20


def create(name: str, spec: DeploymentSpec) -> TorchLLMBackend:
    """Validate a `torch_llm` deployment and return its (unloaded) backend.

    Raises:
        ValueError: bad `options` (the message names the option), a missing model folder or an
            architecture this engine does not implement.
    """
    options = decode_options(spec.options)
    if not spec.model:
        raise ValueError(f"deployment {name!r}: torch_llm needs `model` (a local model folder)")
    folder = pathlib.Path(spec.model)
    if not folder.is_dir():
        raise ValueError(f"deployment {name!r}: model folder {spec.model!r} does not exist")
    if not (folder / "config.json").is_file():
        raise ValueError(f"deployment {name!r}: no config.json in {spec.model!r}")
    try:
        ModelConfig.from_folder(folder)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"deployment {name!r}: {exc}") from None
    if spec.device not in (None, "auto", "cpu", "cuda") and not str(spec.device).startswith("cuda:"):
        raise ValueError(f"deployment {name!r}: device {spec.device!r} is not cpu, cuda, cuda:N or auto")
    _check_adapters(name, spec.adapters, folder, options)
    return TorchLLMBackend(name, folder, options, device=spec.device, adapters=spec.adapters)


def _check_adapters(name: str, adapters: dict[str, str], folder: pathlib.Path, options: LLMOptions) -> None:
    """Refuse at config time an adapter that cannot serve on this base (headers only, no tensors)."""
    if not adapters:
        return
    from backends.torch_llm.lora.weights import inspect_adapter

    base = ModelConfig.from_folder(folder)
    for adapter, path in adapters.items():
        try:
            inspect_adapter(adapter, path, base, max_rank=options.max_lora_rank)
        except ValueError as exc:
            raise ValueError(f"deployment {name!r}: adapter {adapter!r}: {exc}") from None


class TorchLLMBackend:
    """Text generation with the paged-KV continuous-batching engine.

    Args:
        name: deployment name (metrics label).
        folder: local Hugging Face model folder.
        options: decoded engine options.
        device: cpu | cuda | cuda:N | auto (None = auto).
        waiting: the waiting-order policy for the scheduler (FCFS when None).
    """

    capabilities = frozenset({Capability.GENERATE})
    counts_prompt_tokens = True

    def __init__(
        self,
        name: str,
        folder: pathlib.Path,
        options: LLMOptions,
        *,
        device: str | None = None,
        waiting: WaitingQueue | None = None,
        adapters: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.folder = folder
        self.options = options
        self.device = device
        self._waiting = waiting
        self._parts: EngineParts | None = None
        self._engine: AsyncLLMEngine | None = None
        self._grammars: GrammarCompiler | None = None  # output constraints of this model (load)
        self._tool_parser: str | None = None  # reads tool calls under tool_choice auto (load)
        #: prompt ids counted at admission, by request id, waiting for `generate`
        self._tokenized: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()
        self._tokenized_total = 0
        #: the model's sampling defaults (generation_config.json) for fields a request leaves unset
        self._sampling_defaults: dict[str, Any] = {}
        self.capacity: Callable[[], tuple[int, int]] | None = self._free_capacity
        #: adapters declared in the config, loaded with the model
        self._declared_adapters = dict(adapters or {})
        #: adapters requests may use now: name -> folder (owned by the event loop; the engine
        #: thread's pool is changed only through `AsyncLLMEngine.run`)
        self.adapters: dict[str, str] = {}
        #: adapters that could not be loaded: name -> why (requests for them get a 503 saying so)
        self.adapter_errors: dict[str, str] = {}

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._engine is not None

    async def load(self) -> None:
        from backends.torch_llm.async_engine import AsyncLLMEngine
        from backends.torch_llm.factory import build_engine

        parts = await asyncio.to_thread(
            build_engine,
            self.folder,
            self.options,
            device=self.device,
            deployment=self.name,
            waiting=self._waiting,
            adapters=self._declared_adapters,
        )
        self._parts = parts
        self.adapter_errors = dict(parts.adapter_errors)
        self.adapters = {n: p for n, p in self._declared_adapters.items() if n not in self.adapter_errors}
        for adapter, why in self.adapter_errors.items():
            log.error("llm_adapter_load_failed", deployment=self.name, adapter=adapter, error=why)
        self._sampling_defaults = read_sampling_defaults(self.folder)
        self._tool_parser = self.options.tool_parser or default_parser(parts.tokenizer.chat_template)
        o = self.options
        self._grammars = GrammarCompiler(
            parts.tokenizer, parts.config.vocab_size, parts.engine.config.eos_token_ids,
            cache_size=o.grammar_cache_size, timeout_s=o.grammar_compile_timeout_s,
        )  # fmt: skip
        await asyncio.to_thread(self._grammars.warm)
        self._engine = AsyncLLMEngine(parts.engine, name=self.name)
        self._engine.start()
        log.info(
            "llm_loaded",
            deployment=self.name,
            device=str(parts.device),
            dtype=str(parts.dtype).removeprefix("torch."),
            kv_blocks=parts.num_blocks,
            max_model_len=parts.max_model_len,
        )

    async def warmup(self) -> None:
        """Run one short generation so the first real request does not pay for lazy initialisation."""
        request = GenerateRequest(
            request_id=f"warmup-{self.name}",
            prompt_token_ids=[0] * 8,
            sampling=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
        async for _ in self.generate(request):
            pass

    async def close(self) -> None:
        if self._engine is not None:
            engine, self._engine = self._engine, None
            await engine.close()
        if self._grammars is not None:
            self._grammars.close()

    def metadata(self) -> ModelMetadata:
        extra: dict[str, Any] = {"block_size": self.options.block_size, "folder": str(self.folder)}
        device = self.device or "auto"
        if self._parts is not None:
            p = self._parts
            device = str(p.device)
            extra |= {
                "dtype": str(p.dtype).removeprefix("torch."),
                "max_model_len": p.max_model_len,
                "num_kv_blocks": p.num_blocks,
                "model_type": p.config.model_type,
            }
        return ModelMetadata(
            name=self.name,
            platform="pytorch",
            inputs=[TensorSpec(name="text_input", datatype="BYTES", shape=(-1,))],
            outputs=[TensorSpec(name="text_output", datatype="BYTES", shape=(-1,))],
            device=device,
            extra=extra,
        )

    # --- adapters ------------------------------------------------------------------------------

    async def load_adapter(self, adapter: str, path: str) -> None:
        """Load a LoRA adapter while serving; requests in flight are not disturbed. A name in use
        must be unloaded first (and its requests in flight finish) before it is loaded again.

        Raises:
            InvalidInput: the adapter cannot serve on this base (the reason is in the message), or
                this deployment has no LoRA layers (`adapters` or `options.enable_lora`).
            BackendUnavailable: the deployment is not loaded.
        """
        from backends.torch_llm.lora.weights import load_adapter

        engine, parts = self._engine, self._parts
        if engine is None or parts is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        if adapter in self.adapters:
            raise InvalidInput(
                f"adapter {adapter!r} is loaded; unload it first to load other weights under its name"
            )
        if parts.lora is None:
            raise InvalidInput(
                f"deployment {self.name!r} serves no adapters: declare `adapters` or set "
                "`options.enable_lora: true` (LoRA layers are added when the model loads)"
            )
        try:  # reading and checking the weights is file I/O and copies: off the loop and the engine
            weights = await asyncio.to_thread(
                load_adapter,
                adapter,
                path,
                parts.config,
                max_rank=self.options.max_lora_rank,
                dtype=parts.dtype,
            )
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"adapter {adapter!r}: {exc}") from None
        lora = parts.lora
        try:
            await engine.run(lambda _: lora.add(weights))
        except (
            ValueError
        ) as exc:  # the name still serves requests after an unload, or shapes the pool refuses
            raise InvalidInput(str(exc)) from None
        self.adapters[adapter] = str(path)
        self.adapter_errors.pop(adapter, None)
        log.info("llm_adapter_loaded", deployment=self.name, adapter=adapter, rank=weights.max_rank)

    async def unload_adapter(self, adapter: str) -> bool:
        """Stop serving `adapter`; its requests in flight run to their end. False when unknown."""
        self.adapter_errors.pop(adapter, None)
        if self.adapters.pop(adapter, None) is None:
            return False
        if self._engine is not None and self._parts is not None and self._parts.lora is not None:
            lora = self._parts.lora
            await self._engine.run(lambda _: lora.remove(adapter))
        log.info("llm_adapter_unloaded", deployment=self.name, adapter=adapter)
        return True

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is None or adapter in self.adapters:
            return
        why = self.adapter_errors.get(adapter)
        if why is not None:
            raise BackendUnavailable(f"adapter {adapter!r} failed to load on deployment {self.name!r}: {why}")
        raise ModelNotFound(f"model {adapter!r} is not loaded on deployment {self.name!r}")

    # --- serving -------------------------------------------------------------------------------

    def _free_capacity(self) -> tuple[int, int]:
        """(free sequence slots, free KV blocks) as of the engine's last step; (0, 0) before load."""
        return self._engine.capacity if self._engine is not None else (0, 0)

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        """Prompt tokens `request` will use (after the chat template), for reservations.

        The ids are kept for `generate` of the same request id, so a prompt is tokenized once.
        """
        check_supported(request)  # before admission: a request this engine cannot honour costs nothing
        self._check_adapter(request.adapter)
        tools = plan_tools(request, self._tool_parser)
        request = tools.constrained(request) if tools else request
        await self._grammar(request)  # compiled (and cached) now: a schema it cannot enforce costs nothing
        ids = await self._tokenize(request)
        self._tokenized[request.request_id] = (fingerprint(request), ids)
        self._tokenized_total += len(ids)
        # Refused requests (rate limit, queue full, fallback) never take theirs: bounded by tokens,
        # oldest first, so a tenant at its limit cannot make this grow.
        while self._tokenized_total > _MAX_TOKENIZED_TOKENS and self._tokenized:
            self._tokenized_total -= len(self._tokenized.popitem(last=False)[1][1])
        return len(ids)

    async def _tokenize(self, request: GenerateRequest) -> list[int]:
        parts = self._parts
        vocab, max_len = (parts.config.vocab_size, parts.max_model_len) if parts else (None, None)
        return await tokenize(request, self._tokenizer, vocab, max_len)

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream tokens; the last event has `finish_reason` and `usage`.

        Raises:
            InvalidInput: no/ambiguous prompt, bad sampling parameters, prompt too long.
            BackendUnavailable: not loaded.
        """
        engine = self._engine
        if engine is None or self._parts is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        counted = self._tokenized.pop(request.request_id, None)
        if counted is not None:
            self._tokenized_total -= len(counted[1])
        ids = counted[1] if counted and counted[0] == fingerprint(request) else await self._tokenize(request)
        check_supported(request)
        self._check_adapter(request.adapter)
        tools = plan_tools(request, self._tool_parser)  # tool calls read from the text, if asked for
        request = tools.constrained(request) if tools else request
        calls = tools.output() if tools else None
        sampling = with_model_defaults(request.sampling, self._sampling_defaults)
        check_sampling(sampling)
        try:  # checked here too: a refusal inside the engine thread would end the stream as an error
            check_token_biases(sampling.logit_bias, self._parts.config.vocab_size)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        max_len = self._parts.max_model_len
        if len(ids) >= max_len:
            raise InvalidInput(
                f"the prompt has {len(ids)} tokens; this deployment's max_model_len is {max_len} "
                f"(prompt + output), so at most {max_len - 1} prompt tokens fit"
            )
        scope = (request.tenant or "") if self.options.prefix_cache_scope == "tenant" else ""
        grammar = await self._grammar(request)
        try:
            queue = engine.add(request.request_id, ids, sampling, scope, request.adapter, grammar)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        completion = 0
        finished = False
        try:
            while True:
                out = await queue.get()
                if out.finish_reason in FAILED:
                    finished = True  # the engine has already let go of it
                    raise failure(self.name, out.finish_reason, out.error)
                completion += len(out.token_ids)
                done = out.finish_reason is not None
                usage = None
                if done:  # the prompt, of which the prefix cache served `cached_prompt_tokens`
                    usage = Usage(prompt_tokens=len(ids), completion_tokens=completion, cached_prompt_tokens=out.cached_prompt_tokens)  # fmt: skip
                event = TokenEvent(
                    request_id=request.request_id,
                    text=out.text,
                    token_ids=out.token_ids,
                    logprobs=out.logprobs,
                    token_logprobs=token_logprobs(out, self._tokenizer) if sampling.logprobs else None,
                    finish_reason=out.finish_reason,
                    usage=usage,
                )
                yield calls.rewrite(event) if calls else event
                if done:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect): free the blocks
                engine.abort_nowait(request.request_id)

    async def _grammar(self, request: GenerateRequest) -> Any:
        """The compiled grammar of the request's output constraint (None: free text)."""
        if request.sampling.structured is None or self._grammars is None:
            return None
        return await self._grammars.for_request(request.sampling.structured)

    def _tokenizer(self) -> Any:
        if self._parts is None or self._parts.tokenizer is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        return self._parts.tokenizer
