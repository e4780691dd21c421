"""How a deployment is described in the config: one running model on one backend.

`gateway/config/` decodes the `deployments:` section into these Structs; each adapter module
exposes `create(name, spec) -> Backend` (cheap: validates, loads nothing) and the backend's own
`load()` does the heavy work. Adapter-specific knobs live in `options` and are decoded by the
adapter into its own Struct, so an error names the path (`options.block_size`).
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import msgspec
import msgspec.inspect as mi

from fleetgate.spec import SpecBase

__all__ = ["SpecBase", "decode_options", "with_choices"]  # SpecBase: re-exported for the adapters' option Structs


OptionsT = TypeVar("OptionsT", bound=msgspec.Struct)


def decode_options(raw: dict[str, Any], options_type: type[OptionsT]) -> OptionsT:
    """A deployment's `options` mapping as the adapter's own Struct; every adapter decodes with this.

    Raises:
        ValueError: one line naming the option, `options: <what is wrong> - at `options.<name>``.
    """
    try:
        return msgspec.convert(raw, options_type)
    except msgspec.ValidationError as exc:
        message = with_choices(str(exc), options_type)
        raise ValueError(f"options: {message.replace('`$', '`options')}") from None


#: one step of a msgspec error path: `.field`, `[3]` (list item) or `[...]` (dict value)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def with_choices(message: str, root: Any) -> str:
    """msgspec's `Invalid enum value 'x' - at `$.a.b`` with the values the field accepts, found by
    walking `root`'s type along the path: `... 'x' (expected one of: p, q) - at `$.a.b``."""
    if not message.startswith("Invalid enum value"):
        return message
    head, sep, where = message.partition(" - at `$")
    nodes: list[Any] = [mi.type_info(root)]
    for field, index in _STEP.findall(where.rstrip("`")):
        nodes = [child for node in nodes for child in _children(node, field, index)]
    values = [v for node in nodes for v in _literals(node)]
    if not values:
        return message
    return f"{head} (expected one of: {', '.join(map(str, values))}){sep}{where}"


def _unwrap(node: Any) -> list[Any]:
    if isinstance(node, mi.Metadata):
        return _unwrap(node.type)
    if isinstance(node, mi.UnionType):
        return [leaf for member in node.types for leaf in _unwrap(member)]
    return [node]


def _children(node: Any, field: str, index: str) -> list[Any]:
    out = []
    for leaf in _unwrap(node):
        if field and isinstance(leaf, mi.StructType):
            out += [f.type for f in leaf.fields if f.encode_name == field]
        elif index == "..." and isinstance(leaf, mi.DictType):
            out.append(leaf.value_type)
        elif index.isdigit() and isinstance(leaf, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
            out.append(leaf.item_type)
    return out


def _literals(node: Any) -> list[Any]:
    values: list[Any] = []
    for leaf in _unwrap(node):
        if isinstance(leaf, mi.LiteralType):
            values += leaf.values
        elif isinstance(leaf, mi.EnumType):
            values += [member.value for member in leaf.cls]
    return values




#: `device:` of an onnxruntime deployment: a label until the session tells where it runs (the
#: first provider decides); the providers choose the hardware, so only these spellings are taken
ONNX_DEVICES = "cpu, cuda, cuda:N or auto"


def onnx_device_problem(device: str) -> str | None:
    """Why `device` is not an onnxruntime deployment's device, or None."""
    if device in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", device):
        return None
    return (
        f"unknown onnxruntime device {device!r}: use {ONNX_DEVICES} (the `providers` list chooses "
        "where the model runs)"
    )


class BatchingSpec(SpecBase):
    """Dynamic batching for tensor backends (merge concurrent requests along dimension 0)."""

    #: most rows in one merged batch
    max_batch_size: int = 32
    #: how long the first request of a batch may wait for company (see `mode`)
    max_delay_ms: float = 2.0
    #: requests waiting for a batch at most; one more is refused (backend unavailable)
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

    #: folder holding the encoder's `tokenizer.json` (a local path or a model address, like `model`)
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

    #: the runtime or server that runs the model; its `options` are listed per backend
    backend: Literal["onnxruntime", "openvino", "tfserving", "remote", "torch_llm", "openvino_llm"]
    #: the model of an in-process runtime (file or folder): a local path, or an address fetched into
    #: the cache, hf://org/name[@revision][/path], s3://bucket/key-or-prefix, https://host/file[#sha256=HEX]
    model: str | None = None
    #: cpu | cuda | cuda:N | auto for torch/onnx; CPU | GPU | AUTO | HETERO:... for OpenVINO; CPU | GPU |
    #: NPU | AUTO for openvino_llm
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
    #: per-request deadline towards the backend (remote: a whole non-streamed answer, a stream's
    #: head and then each of its events)
    timeout_s: float = 60.0
    #: free-form hardware label shown on metrics and in the response header (e.g. "h200", "xeon")
    hardware: str | None = None
    #: merge concurrent tensor requests into one runtime call (null: every request runs alone)
    batching: BatchingSpec | None = None
    #: serve this tensor deployment as a sentence-embedding model (onnxruntime, openvino)
    embedding: EmbeddingSpec | None = None
    #: LoRA adapters on this base model (torch_llm): model name -> PEFT adapter folder (a local path
    #: or a model address). Each name is
    #: a model clients call, routed to this deployment and tenant-scoped like any model.
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    #: the backend's own settings, decoded into its options Struct (see below)
    options: dict[str, Any] = msgspec.field(default_factory=dict)
