"""The Backend protocol and the internal request/response types every adapter speaks.

Protocol adapters in `gateway/` translate HTTP shapes (OpenAI, Open Inference Protocol v2,
TF Serving REST) into these types and back; backends never see HTTP. Tensors travel as numpy
arrays plus their v2 name/datatype/shape, so a response can be encoded in any protocol.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np

# --- datatypes ---------------------------------------------------------------------------------

#: Open Inference Protocol v2 datatype -> numpy dtype. BYTES is an object array of `bytes`.
V2_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
NUMPY_TO_V2: dict[np.dtype, str] = {dt: name for name, dt in V2_TO_NUMPY.items()}


def v2_datatype(array: np.ndarray) -> str:
    """The v2 datatype name of a numpy array (str/bytes/object arrays are BYTES)."""
    if array.dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return NUMPY_TO_V2[array.dtype]
    except KeyError:
        raise TypeError(f"numpy dtype {array.dtype} has no Open Inference Protocol datatype") from None


# --- tensors -----------------------------------------------------------------------------------


class Tensor(msgspec.Struct, kw_only=True):
    """One named tensor. `data` always has `shape` and the numpy dtype of `datatype`."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Any  # np.ndarray; typed Any so msgspec never tries to validate it

    @classmethod
    def from_array(cls, name: str, array: np.ndarray) -> Tensor:
        return cls(name=name, datatype=v2_datatype(array), shape=tuple(array.shape), data=array)


class TensorSpec(msgspec.Struct, kw_only=True):
    """An input or output of a model: -1 in `shape` marks a dynamic dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]


class ModelMetadata(msgspec.Struct, kw_only=True):
    """What a loaded deployment serves: v2 `platform` plus the device it really runs on."""

    name: str
    platform: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    device: str = "cpu"
    versions: list[str] = msgspec.field(default_factory=list)
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


class TensorRequest(msgspec.Struct, kw_only=True):
    """An inference request for a tensor model. `outputs=None` means every output."""

    id: str
    inputs: list[Tensor]
    outputs: list[str] | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def batch_rows(self) -> int:
        """Rows along dimension 0 of the first input: the unit of tensor cost."""
        if not self.inputs or not self.inputs[0].shape:
            return 1
        return max(1, int(self.inputs[0].shape[0]))


class TensorResponse(msgspec.Struct, kw_only=True):
    id: str
    outputs: list[Tensor]
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


# --- text generation ---------------------------------------------------------------------------


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the generated text, enforced token by token by the engine's grammar.

    Exactly one field is set. Every protocol's request fields (OpenAI `response_format`, vLLM's
    `structured_outputs` and `guided_*`, a tool choice that must be called) map to this one shape,
    so a backend enforces one thing, and a compiled grammar is cached by it (it is hashable).
    """

    #: a JSON schema, as canonical JSON text (sorted keys): the output is one JSON value it accepts
    json_schema: str | None = None
    #: any JSON object (OpenAI's `{"type": "json_object"}`)
    json_object: bool = False
    #: a regular expression the whole output matches
    regex: str | None = None
    #: the output is exactly one of these strings
    choice: tuple[str, ...] | None = None
    #: a grammar in EBNF (GBNF/xgrammar syntax), rooted at `root`
    grammar: str | None = None


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick tokens. temperature == 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    #: with `logprobs`: the most likely alternatives to report per token (0..20)
    top_logprobs: int = 0
    #: OpenAI's penalties on the logits of tokens already generated: once (presence) and per time
    #: (frequency), -2..2; `repetition_penalty` (> 0, 1 = off) divides the positive logits (and
    #: multiplies the negative ones) of every token seen in the prompt or the output, as HF does
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: added to the logits of these token ids (-100..100)
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    #: end-of-sequence and stop tokens are not chosen before this many tokens
    min_tokens: int = 0
    #: fields the caller left unset (an OpenAI request without `temperature`...): a backend may
    #: fill them from the model's own defaults (`generation_config.json`), as vLLM does
    model_defaults: frozenset[str] = frozenset()
    #: the output must follow this constraint (None: free text)
    structured: StructuredOutput | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str
    #: tool context, handed to upstreams that serve tools (OpenAI's shapes, as the client sent them):
    #: an assistant turn's `tool_calls`, a tool turn's `tool_call_id`, a participant's `name`
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """A text-generation request: exactly one of `prompt`, `prompt_token_ids` or `messages`.

    `messages` is a chat; the backend applies its own chat template (or forwards the chat as is).
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    tenant: str | None = None
    #: Name the upstream server should see (remote backends); None = the deployment's own.
    upstream_model: str | None = None
    #: the LoRA adapter to run with (the model name a client called, when it is an adapter of the
    #: deployment's base); None: the base model
    adapter: str | None = None
    #: the caller reads the answer as a stream; False: only the whole answer is used, so a backend
    #: that can may produce it in one piece (a remote upstream asked for plain JSON, not SSE)
    stream: bool = True
    #: OpenAI sampling fields only some backends honour (penalties, logit_bias, response_format,
    #: min_tokens), as the client sent them: a remote upstream receives them, a backend that cannot
    #: honour one refuses the request naming it (never drops it silently)
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    #: OpenAI `tools` (function definitions, as the client sent them), rendered into the prompt by the
    #: model's own chat template; the backend parses the model's tool calls out of its output
    tools: list[dict[str, Any]] | None = None
    #: OpenAI `tool_choice` as sent ("none" | "auto" | "required" | {"type": "function", ...})
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: of `prompt_tokens`, those served from a reused prefix (a prompt cache) rather than computed:
    #: what the engine or an upstream reports, priced at `cached_input_usd_per_mtok`; 0 when unknown
    cached_prompt_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenLogprob(msgspec.Struct, kw_only=True):
    """A token as OpenAI's logprobs show it: its text, its raw bytes, its log-probability, and the
    most likely alternatives at its position (each without alternatives of its own)."""

    token: str
    bytes: list[int]
    logprob: float
    top: list[TokenLogprob] = msgspec.field(default_factory=list)


class TokenEvent(msgspec.Struct, kw_only=True):
    """One step of a generation stream.

    `text` is the newly decoded text (may be empty while a multi-byte character is incomplete).
    The last event has `finish_reason` set ("stop", "length", "abort", "error") and `usage`.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] | None = None
    #: with `sampling.logprobs`: one entry per token of `token_ids` (text, bytes, logprob, alternatives)
    token_logprobs: list[TokenLogprob] | None = None
    #: tool calls of an upstream that serves tools, in OpenAI's shape: whole calls in a whole answer,
    #: deltas (by `index`, arguments in pieces) in a stream
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None


# --- token estimates --------------------------------------------------------------------------

#: UTF-8 bytes per token assumed where no tokenizer counts (remote prompts, and output text of
#: events without token ids): about right for English text and BPE vocabularies, high for code.
BYTES_PER_TOKEN = 4


def estimate_text_tokens(text: str) -> int:
    """Tokens in `text` by the `BYTES_PER_TOKEN` rule, rounded up."""
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


def estimate_prompt_tokens(request: GenerateRequest) -> int:
    """A conservative prompt size for a backend that does not tokenize (a remote upstream)."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    text = request.prompt or "".join(m.content for m in request.messages or [])
    return max(1, estimate_text_tokens(text) + 4 * len(request.messages or []))


# --- the protocol ------------------------------------------------------------------------------


class Capability(enum.Enum):
    TENSOR = "tensor"  # implements infer()
    GENERATE = "generate"  # implements generate() / abort()
    EMBED = "embed"  # implements prepare_embedding() / embed()


#: called with the number of requests and rows of each runtime batch a tensor backend runs (metrics)
BatchObserver = Callable[[int, int], None]


@runtime_checkable
class Backend(Protocol):
    """What every adapter implements: its lifecycle and what it serves.

    Lifecycle: `load()` then `warmup()` during the app's start-up, `close()` at shutdown. Blocking
    runtimes must run off the event loop (a thread, an executor or an async API). What a backend
    serves is declared in `capabilities`; a backend that declares `TENSOR` is a `TensorBackend`, one
    that declares `GENERATE` a `GenerativeBackend` (a backend may be both). Optional features are
    attributes of those protocols, never probed with `hasattr`.
    """

    name: str
    capabilities: frozenset[Capability]

    @property
    def ready(self) -> bool: ...

    async def load(self) -> None: ...

    async def warmup(self) -> None: ...

    async def close(self) -> None: ...

    def metadata(self) -> ModelMetadata: ...


@runtime_checkable
class TensorBackend(Backend, Protocol):
    """A backend that declares `Capability.TENSOR`: runs tensor requests."""

    #: set by the gateway once the deployment is loaded; a backend with a dynamic batcher reports
    #: each runtime batch to it, one without a batcher never calls it
    batch_observer: BatchObserver | None

    async def infer(self, request: TensorRequest) -> TensorResponse: ...


@runtime_checkable
class GenerativeBackend(Backend, Protocol):
    """A backend that declares `Capability.GENERATE`: streams text generations."""

    #: whether `count_prompt_tokens` is exact (the backend tokenizes); False: it is an estimate,
    #: and the usage the backend reports at the end settles the reservation
    counts_prompt_tokens: bool
    #: returns (free sequence slots, free KV blocks) now, for backends with a bounded running batch: the
    #: deployment's fair queue then dispatches only while there is room, so the backend's own
    #: (FCFS) waiting list never absorbs the backlog. None: no such gate.
    capacity: Callable[[], tuple[int, int]] | None

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        """Prompt tokens to reserve at admission for `request` (see `counts_prompt_tokens`)."""
        ...


class EmbedRequest(msgspec.Struct, kw_only=True):
    """Inputs of one embeddings call, tokenized: one list of ids per input (already truncated)."""

    id: str
    token_ids: list[list[int]]
    #: keep the first N components of each vector (rescaled to unit length when the model
    #: normalizes); None: all of them
    dimensions: int | None = None

    @property
    def tokens(self) -> int:
        """Tokens the call costs (its usage)."""
        return sum(len(ids) for ids in self.token_ids)


@runtime_checkable
class EmbeddingBackend(Backend, Protocol):
    """A backend that declares `Capability.EMBED`: turns texts into vectors."""

    def prepare_embedding(
        self, inputs: list[str] | list[list[int]], request_id: str, dimensions: int | None = None
    ) -> EmbedRequest:
        """Tokenize (or check) the inputs and `dimensions`; cheap enough for the event loop, done
        before admission (a refused request costs nothing)."""
        ...

    async def embed(self, request: EmbedRequest) -> np.ndarray:
        """One float32 vector per input, [inputs, dim], pooled (and normalized as configured)."""
        ...


def as_embedding(backend: Backend) -> EmbeddingBackend:
    """`backend` as an embedding backend; raises TypeError when it does not declare `EMBED`."""
    if Capability.EMBED not in backend.capabilities:
        raise TypeError(f"backend {backend.name!r} does not embed text")
    return backend  # type: ignore[return-value]  # declared by its capabilities


def as_tensor(backend: Backend) -> TensorBackend:
    """`backend` as a tensor backend; raises TypeError when it does not declare `TENSOR`."""
    if Capability.TENSOR not in backend.capabilities:
        raise TypeError(f"backend {backend.name!r} does not serve tensors")
    return backend  # type: ignore[return-value]  # declared by its capabilities


def as_generative(backend: Backend) -> GenerativeBackend:
    """`backend` as a generative backend; raises TypeError when it does not declare `GENERATE`."""
    if Capability.GENERATE not in backend.capabilities:
        raise TypeError(f"backend {backend.name!r} does not generate text")
    return backend  # type: ignore[return-value]  # declared by its capabilities
