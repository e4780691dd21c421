"""How a deployment is described in the config: one running model on one backend.

`gateway/config.py` decodes the `deployments:` section into these Structs; each adapter module
exposes `create(name, spec) -> Backend` (cheap: validates, loads nothing) and the backend's own
`load()` does the heavy work. Adapter-specific knobs live in `options` and are decoded by the
adapter into its own Struct, so an error names the path (`options.block_size`).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from fleetgate.spec import SpecBase

__all__ = ["SpecBase", "decode_options"]  # SpecBase: re-exported for the adapters' option Structs


OptionsT = TypeVar("OptionsT", bound=msgspec.Struct)


def decode_options(raw: dict[str, Any], options_type: type[OptionsT]) -> OptionsT:
    """A deployment's `options` mapping as the adapter's own Struct; every adapter decodes with this.

    Raises:
        ValueError: one line naming the option, `options: <what is wrong> - at `options.<name>``.
    """
    try:
        return msgspec.convert(raw, options_type)
    except msgspec.ValidationError as exc:
        raise ValueError(f"options: {str(exc).replace('`$', '`options')}") from None


class BatchingSpec(SpecBase):
    """Dynamic batching for tensor backends (merge concurrent requests along dimension 0)."""

    max_batch_size: int = 32
    max_delay_ms: float = 2.0
    max_queue: int = 1024
    #: `delay` (the default): a request that finds the runtime idle runs at once; the first request
    #: of a batch waits up to `max_delay_ms` for company only while callers overlap (several queued,
    #: or the last batch merged several and its last caller resumed less than `max_delay_ms` ago),
    #: and no longer than until as many are back as the last batch held. `continuous`: never waits
    #: on a timer; requests arriving while every slot is busy are merged into the next batch.
    #: bench_batching_modes.py on a 2-core CPU, last run: the two within 10 % of each other at every
    #: point (digits and the CNN, c = 1 to 128).
    mode: Literal["continuous", "delay"] = "delay"

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.max_delay_ms < 0:
            raise ValueError("max_delay_ms must be >= 0")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")


class EmbeddingSpec(SpecBase):
    """A tensor deployment that is a sentence-embedding encoder (`POST /v1/embeddings`).

    The model takes `input_ids` and `attention_mask` (and `token_type_ids` when it declares one),
    as Hugging Face's ONNX exports do, and returns per-token hidden states [rows, tokens, dim].
    """

    #: folder holding the encoder's `tokenizer.json`
    tokenizer: str
    #: `mean` over the real tokens (attention mask), or the first (`cls`) token's state
    pooling: Literal["mean", "cls"] = "mean"
    #: scale each embedding to unit length (cosine similarity = dot product)
    normalize: bool = True
    #: tokens per input; longer inputs are truncated (as the tokenizer's own truncation does)
    max_length: int = 512
    #: the model output holding the hidden states; default: its first output
    output: str | None = None
    #: inputs per request at most
    max_inputs: int = 2048

    def __post_init__(self) -> None:
        if not 1 <= self.max_length <= 1 << 16:
            raise ValueError("max_length must be in 1..65536")
        if not 1 <= self.max_inputs <= 1 << 16:
            raise ValueError("max_inputs must be in 1..65536")


class DeploymentSpec(SpecBase):
    """One deployment. Which fields apply depends on `backend` (see each adapter)."""

    backend: Literal["onnxruntime", "openvino", "tfserving", "remote", "torch_llm"]
    #: local model path (file or folder) for in-process runtimes
    model: str | None = None
    #: cpu | cuda | cuda:N | auto for torch/onnx; CPU | GPU | AUTO | HETERO:... for OpenVINO
    device: str | None = None
    #: ONNX Runtime execution providers, in order of preference
    providers: list[str] | None = None
    #: host:port of a gRPC server (tfserving)
    target: str | None = None
    #: the model's name on the upstream server (tfserving, remote)
    model_name: str | None = None
    #: base URL of another server (remote)
    url: str | None = None
    #: wire protocol of the upstream server (remote)
    protocol: Literal["openai", "kserve_v2"] | None = None
    #: name of the environment variable holding the upstream API key (never the key itself)
    api_key_env: str | None = None
    #: per-request deadline towards the backend
    timeout_s: float = 60.0
    #: free-form hardware label shown on metrics and in the response header (e.g. "h200", "xeon")
    hardware: str | None = None
    batching: BatchingSpec | None = None
    #: serve this tensor deployment as a sentence-embedding model (onnxruntime, openvino)
    embedding: EmbeddingSpec | None = None
    #: LoRA adapters on this base model (torch_llm): model name -> PEFT adapter folder. Each name is
    #: a model clients call, routed to this deployment and tenant-scoped like any model.
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    options: dict[str, Any] = msgspec.field(default_factory=dict)
