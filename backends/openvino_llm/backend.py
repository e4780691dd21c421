"""The `openvino_llm` backend: LLMs on OpenVINO GenAI's continuous-batching pipeline.

`create()` checks the export folder and options (imports no OpenVINO); `load()` builds the
pipeline in a worker thread; `generate()` streams `TokenEvent`s from the engine thread
(backends/openvino_llm/engine.py). Prompts are tokenized and chats rendered with the export's
Hugging Face tokenizer files, exactly as the `torch_llm` engine does, so both count the same tokens.
"""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from backends.base import (
    Capability,
    GenerateRequest,
    ModelMetadata,
    SamplingParams,
    TensorSpec,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from backends.errors import BackendInternalError, BackendUnavailable, InvalidInput
from backends.openvino_llm.export import read_manifest
from backends.openvino_llm.options import OpenVINOLLMOptions, device_problem, parse_options
from backends.openvino_llm.sampling import check_request, check_sampling, generation_config
from backends.spec import DeploymentSpec
from backends.torch_llm.model.config import read_sampling_defaults, with_model_defaults
from backends.torch_llm.requests import prompt_ids

log = structlog.get_logger(__name__)

#: files an export must hold (what the pipeline loads, and what the backend tokenizes with)
REQUIRED_FILES = ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml", "tokenizer.json")


def create(name: str, spec: DeploymentSpec) -> OpenVINOLLMBackend:
    """Validate an `openvino_llm` deployment and return its (unloaded) backend.

    Raises:
        ValueError: bad `options` (naming the option), a bad device, or a folder that is not an export.
    """
    options = parse_options(spec.options)
    if not spec.model:
        raise ValueError(f"deployment {name!r}: openvino_llm needs `model` (a folder made by `fleetgate export-llm`)")
    folder = pathlib.Path(spec.model)
    if not folder.is_dir():
        raise ValueError(f"deployment {name!r}: model folder {spec.model!r} does not exist")
    missing = [f for f in REQUIRED_FILES if not (folder / f).is_file()]
    if missing:
        raise ValueError(
            f"deployment {name!r}: {spec.model!r} is not an OpenVINO LLM export (missing {', '.join(missing)}); "
            "make one with `fleetgate export-llm`"
        )
    device = (spec.device or "CPU").upper()
    problem = device_problem(device)
    if problem:
        raise ValueError(f"deployment {name!r}: {problem}")
    if spec.adapters:
        raise ValueError(f"deployment {name!r}: LoRA adapters are not served by openvino_llm")
    return OpenVINOLLMBackend(name, folder, options, device=device)


class OpenVINOLLMBackend:
    """Text generation on a ContinuousBatchingPipeline.

    Args:
        name: deployment name (metrics label).
        folder: the export folder.
        options: decoded pipeline options.
        device: CPU | GPU | NPU | AUTO.
    """

    capabilities = frozenset({Capability.GENERATE})
    counts_prompt_tokens = True

    def __init__(self, name: str, folder: pathlib.Path, options: OpenVINOLLMOptions, *, device: str = "CPU") -> None:
        self.name = name
        self.folder = folder
        self.options = options
        self.device = device
        self._engine: Any = None  # PipelineEngine once loaded
        self._tokenizer: Any = None  # TextTokenizer once loaded
        self._base_config: Any = None  # the pipeline's default GenerationConfig
        self._eos_ids: set[int] = set()
        self._sampling_defaults: dict[str, Any] = {}
        self._max_model_len = 0
        self.capacity: Callable[[], tuple[int, int]] | None = self._free_capacity

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._engine is not None

    async def load(self) -> None:
        from backends.openvino_llm.engine import PipelineEngine

        pipeline, tokenizer = await asyncio.to_thread(self._build)
        self._tokenizer = tokenizer
        self._base_config = pipeline.get_config()
        self._sampling_defaults = read_sampling_defaults(self.folder)
        self._eos_ids = _eos_ids(self.folder, tokenizer)
        self._max_model_len = _max_model_len(self.folder)
        engine = PipelineEngine(pipeline, tokenizer, name=self.name, max_num_seqs=self.options.max_num_seqs)
        engine.start()
        self._engine = engine
        log.info("openvino_llm_loaded", deployment=self.name, device=self.device, **self._details())

    def _build(self) -> tuple[Any, Any]:
        import openvino_genai as ov_genai

        from backends.torch_llm.tokenizer import TextTokenizer

        o = self.options
        scheduler = ov_genai.SchedulerConfig()
        if o.num_kv_blocks is not None:
            scheduler.num_kv_blocks = o.num_kv_blocks
        else:
            scheduler.cache_size = o.cache_size_gb
        scheduler.max_num_seqs = o.max_num_seqs
        scheduler.max_num_batched_tokens = o.max_num_batched_tokens
        scheduler.enable_prefix_caching = o.enable_prefix_caching
        scheduler.dynamic_split_fuse = o.dynamic_split_fuse
        try:
            pipeline = ov_genai.ContinuousBatchingPipeline(str(self.folder), scheduler, self.device, o.properties())
        except RuntimeError as exc:
            raise RuntimeError(f"OpenVINO GenAI could not load {self.folder}: {' '.join(str(exc).split())[:400]}") from None
        return pipeline, TextTokenizer(self.folder)

    async def warmup(self) -> None:
        """One short generation, so the first request does not pay for the plugin's compilation."""
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

    def _details(self) -> dict[str, Any]:
        """Device, precision and weight format in use (the deployment's details)."""
        manifest = read_manifest(self.folder)
        return {
            "folder": str(self.folder),
            "weights": manifest.weights if manifest else _weight_format(self.folder),
            "precision": self.options.precision,
            "kv_cache_precision": self.options.kv_cache_precision,
            "max_num_seqs": self.options.max_num_seqs,
            "prefix_caching": self.options.enable_prefix_caching,
            "max_model_len": self._max_model_len or None,
            "architecture": manifest.architecture if manifest else None,
        }

    def metadata(self) -> ModelMetadata:
        return ModelMetadata(
            name=self.name,
            platform="openvino_genai",
            inputs=[TensorSpec(name="text_input", datatype="BYTES", shape=(-1,))],
            outputs=[TensorSpec(name="text_output", datatype="BYTES", shape=(-1,))],
            device=self.device,
            extra=self._details(),
        )

    # --- serving -------------------------------------------------------------------------------

    def _free_capacity(self) -> tuple[int, int]:
        return self._engine.capacity if self._engine is not None else (0, 0)

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        """Prompt tokens after the chat template (exact: the same tokenizer serves the request)."""
        check_request(request)
        return len(await asyncio.to_thread(self._prompt_ids, request))

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort_nowait(request_id)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream tokens; the last event has `finish_reason` and `usage`.

        Raises:
            InvalidInput: a field this backend does not serve, bad sampling values, a prompt too long.
            BackendUnavailable: not loaded.
        """
        from backends.openvino_llm.engine import merge

        engine = self._engine
        if engine is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        check_request(request)
        sampling = with_model_defaults(request.sampling, self._sampling_defaults)
        check_sampling(sampling)
        ids = self._prompt_ids(request)
        config = generation_config(self._base_config, sampling, set() if sampling.ignore_eos else self._eos_ids)
        queue = engine.add(
            request.request_id, ids, config, sampling.stop, logprobs=sampling.logprobs, max_tokens=sampling.max_tokens
        )
        completion = 0
        finished = False
        try:
            while True:
                out = await queue.get()
                while out.finish_reason is None and not queue.empty():  # fell behind: one event
                    out = merge(out, queue.get_nowait())
                if out.finish_reason in ("error", "abort"):
                    finished = True
                    raise _failure(self.name, out.finish_reason, out.error)
                completion += len(out.token_ids)
                done = out.finish_reason is not None
                yield TokenEvent(
                    request_id=request.request_id,
                    text=out.text,
                    token_ids=out.token_ids,
                    logprobs=out.logprobs,
                    token_logprobs=self._token_logprobs(out.token_ids, out.logprobs) if sampling.logprobs else None,
                    finish_reason=out.finish_reason,
                    usage=Usage(prompt_tokens=len(ids), completion_tokens=completion) if done else None,
                )
                if done:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away (client disconnect): free the sequence
                engine.abort_nowait(request.request_id)

    def _token_logprobs(self, ids: list[int], logprobs: list[float] | None) -> list[TokenLogprob] | None:
        if logprobs is None:
            return None
        entries = []
        for token_id, logprob in zip(ids, logprobs, strict=False):
            raw = self._tokenizer.token_bytes(token_id)
            entries.append(TokenLogprob(token=raw.decode("utf-8", "replace"), bytes=list(raw), logprob=logprob))
        return entries

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        tok = self._tokenizer
        if tok is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        # the same tokenizer class as the torch engine's: one reading of prompt, ids or chat
        ids = prompt_ids(request, lambda: tok, tok.vocab_size)
        if self._max_model_len and len(ids) + request.sampling.max_tokens > self._max_model_len:
            raise InvalidInput(
                f"the prompt has {len(ids)} tokens and max_tokens is {request.sampling.max_tokens}; this "
                f"model's context is {self._max_model_len} tokens"
            )
        return ids


def _failure(deployment: str, reason: str, detail: str | None) -> Exception:
    if reason == "abort":
        return BackendUnavailable(f"deployment {deployment!r} stopped before the generation finished")
    return BackendInternalError(
        f"the generation failed on deployment {deployment!r}" + (f": {detail}" if detail else "")
    )


def _eos_ids(folder: pathlib.Path, tokenizer: Any) -> set[int]:
    """End-of-sequence ids: generation_config.json's (one or a list), else the tokenizer's."""
    import json

    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(eos) if isinstance(eos, list) else ({eos} if isinstance(eos, int) else set())
            if ids:
                return ids
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


def _max_model_len(folder: pathlib.Path) -> int:
    import json

    path = folder / "config.json"
    if not path.is_file():
        return 0
    return int(json.loads(path.read_text()).get("max_position_embeddings") or 0)


def _weight_format(folder: pathlib.Path) -> str:
    """The weight format of an export made elsewhere, from the IR's constants' element types."""
    text = (folder / "openvino_model.xml").read_text(errors="replace")
    for marker, name in (('element_type="u4"', "int4"), ('element_type="i4"', "int4"), ('element_type="u8"', "int8")):
        if marker in text:
            return name
    return "fp16" if 'element_type="f16"' in text else "fp32"
