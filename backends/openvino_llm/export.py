"""Turn a Hugging Face causal-LM folder into the export OpenVINO GenAI's pipelines load.

The way is written up in docs/decisions/openvino-llm-export.md. In short: the model is traced with
OpenVINO's PyTorch frontend (`ov.convert_model`) around a small wrapper that takes the past keys and
values as plain tensors, then made stateful the way `ContinuousBatchingPipeline` expects before it
applies its paged-attention transformation (SDPAToPagedAttention): every past tensor is read from a
variable, reordered by a `beam_idx` Gather, and initialised to an empty [batch, heads, 0, head_dim]
tensor. The tokenizer and detokenizer IRs come from `openvino_tokenizers.convert_tokenizer`; int8
and int4 weights from `nncf.compress_weights`. Hugging Face's tokenizer files are copied too: the
backend tokenizes and renders chats with them, exactly as the `torch_llm` engine does.
"""

from __future__ import annotations

import pathlib
import shutil
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

#: how the weights are stored in the export
WeightFormat = Literal["fp32", "fp16", "int8", "int4"]
WEIGHT_FORMATS: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")

#: written beside the IR: what the export holds (the backend reports it in the deployment's details)
MANIFEST = "fleetgate_export.json"
#: Hugging Face files the backend reads (tokenizer, chat template, sampling defaults, architecture)
_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
#: int4 group size when the hidden size allows it (NNCF's default for LLMs); per-channel otherwise
_INT4_GROUP = 128


class ExportError(Exception):
    """An export that cannot be made; the message is one line saying why."""


class ExportManifest(msgspec.Struct, kw_only=True):
    """What `export_llm` wrote, saved as `fleetgate_export.json` in the export folder."""

    #: weight storage: fp32 | fp16 | int8 | int4
    weights: str
    #: the Hugging Face architecture (`LlamaForCausalLM`...)
    architecture: str
    #: the folder it was exported from
    source: str
    layers: int
    kv_heads: int
    head_dim: int
    openvino: str
    #: seconds the export took
    seconds: float = 0.0


def read_manifest(folder: pathlib.Path) -> ExportManifest | None:
    """The manifest of an export made by `export_llm` (None for one made elsewhere)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=ExportManifest)
    except msgspec.DecodeError:
        return None


def export_llm(
    model: pathlib.Path,
    out: pathlib.Path,
    weights: WeightFormat = "fp32",
    progress: Callable[[str], None] = lambda _: None,
) -> ExportManifest:
    """Export the Hugging Face folder `model` into `out` (created; files in it are overwritten).

    Raises:
        ExportError: the folder is not a causal LM this exporter can trace, a dependency is
            missing, or a step failed (one line naming the step).
    """
    if weights not in WEIGHT_FORMATS:
        raise ExportError(f"--weights {weights!r}: use one of {', '.join(WEIGHT_FORMATS)}")
    if not (model / "config.json").is_file():
        raise ExportError(f"{model} is not a Hugging Face model folder (no config.json)")
    if not (model / "tokenizer.json").is_file():
        raise ExportError(f"{model} has no tokenizer.json (a fast tokenizer is needed for the tokenizer IRs)")
    try:
        import openvino as ov
        import torch
        import transformers
    except ImportError as exc:
        raise ExportError(f"export-llm needs torch, transformers and openvino ({exc.name} is missing)") from None
    started = time.perf_counter()
    progress(f"loading {model}")
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa", dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"cannot load {model} with transformers: {_one_line(exc)}") from None
    hf.eval()
    shape = _kv_shape(hf.config)
    progress(f"tracing {type(hf).__name__} ({shape[0]} layers) with OpenVINO's PyTorch frontend")
    try:
        ov_model = _trace(ov, torch, transformers, hf, shape)
    except Exception as exc:  # the frontend raises its own types; any of them ends the export
        raise ExportError(f"tracing failed: {_one_line(exc)}") from None
    progress("making the KV cache stateful (the paged-attention pipeline's input)")
    _make_stateful(ov, ov_model, shape)
    if weights in ("int8", "int4"):
        progress(f"compressing weights to {weights} with NNCF")
        ov_model = _compress(ov_model, weights, hf.config.hidden_size)
    out.mkdir(parents=True, exist_ok=True)
    progress(f"writing {out / 'openvino_model.xml'}")
    ov.save_model(ov_model, out / "openvino_model.xml", compress_to_fp16=weights == "fp16")
    progress("converting the tokenizer and detokenizer")
    _tokenizers(ov, transformers, model, out)
    for name in _COPIED:
        if (model / name).is_file():
            shutil.copyfile(model / name, out / name)
    manifest = ExportManifest(
        weights=weights,
        architecture=(hf.config.architectures or [type(hf).__name__])[0],
        source=str(model),
        layers=shape[0],
        kv_heads=shape[1],
        head_dim=shape[2],
        openvino=ov.get_version(),
        seconds=round(time.perf_counter() - started, 2),
    )
    (out / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
    progress(f"done in {manifest.seconds:.1f} s")
    return manifest


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "") if text else type(exc).__name__


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a decoder config."""
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return layers, kv_heads, head_dim


def _kv_names(layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]


def _trace(ov: Any, torch: Any, transformers: Any, hf: Any, shape: tuple[int, int, int]) -> Any:
    """The stateless model: (input_ids, position_ids, past...) -> (logits, present...)."""
    layers, kv_heads, head_dim = shape
    config = hf.config

    class PastAsTensors(torch.nn.Module):
        """Takes the past as tensors, so the trace has one Parameter per past key and value.

        No attention mask: the paged-attention transformation removes it, and a mask input would
        keep the causal-mask subgraph (and the input) alive after the attention is replaced.
        """

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: Any, position_ids: Any, *past: Any) -> tuple[Any, ...]:
            cache = transformers.DynamicCache(config=config)
            for i, layer in enumerate(cache.layers):
                # set, not `update`: a fresh layer starts from an empty 1-D tensor whose concat the
                # trace would keep as a rank-1 constant
                layer.dtype, layer.device = past[2 * i].dtype, past[2 * i].device
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
                layer.is_initialized = True
            result = self.inner(
                input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True
            )
            present = []
            for layer in result.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (result.logits, *present)

    batch, new, old = 2, 3, 4  # example sizes: every one of them is dynamic in the IR
    example = [
        torch.ones(batch, new, dtype=torch.long),
        torch.arange(old, old + new).expand(batch, new).contiguous(),
        *(torch.zeros(batch, kv_heads, old, head_dim) for _ in range(2 * layers)),
    ]
    with torch.no_grad():
        ov_model = ov.convert_model(PastAsTensors(hf), example_input=tuple(example))
    inputs = ["input_ids", "position_ids", *_kv_names(layers, "past_key_values")]
    outputs = ["logits", *_kv_names(layers, "present")]
    for port, name in zip(ov_model.inputs, inputs, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(ov_model.outputs, outputs, strict=True):
        port.get_tensor().set_names({name})
    return ov_model


def _make_stateful(ov: Any, ov_model: Any, shape: tuple[int, int, int]) -> None:
    """Past tensors become variables read through a `beam_idx` Gather, starting empty.

    This is the form SDPAToPagedAttention matches (Gather(ReadValue) concatenated with the new
    keys; ShapeOf of that Gather for the past length, whose initial value must have a static 0).
    """
    import numpy as np
    from openvino import opset13 as ops
    from openvino.passes import MakeStateful, Manager

    layers, kv_heads, head_dim = shape
    past = _kv_names(layers, "past_key_values")
    for name in past:
        ov_model.input(name).get_node().set_partial_shape(ov.PartialShape([-1, kv_heads, -1, head_dim]))
    ov_model.validate_nodes_and_infer_types()
    beam_idx = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    for name in past:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()
        reordered = ops.gather(port, beam_idx, ops.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(reordered.output(0))
    manager = Manager()
    manager.register_pass(MakeStateful(dict(zip(past, _kv_names(layers, "present"), strict=True))))
    manager.run_passes(ov_model)
    ids = ov_model.input("input_ids")
    batch = ops.gather(ops.shape_of(ids, output_type="i64"), ops.constant(np.array([0], dtype=np.int64)), ops.constant(0))
    empty = ops.concat([batch, ops.constant(np.array([kv_heads, 0, head_dim], dtype=np.int64))], 0)
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":
            zero = ops.constant(np.zeros((), dtype=op.get_output_element_type(0).to_dtype()))
            op.set_arguments([ops.broadcast(zero, empty)])
    ov_model.validate_nodes_and_infer_types()


def _compress(ov_model: Any, weights: str, hidden_size: int) -> Any:
    """int8 (per channel, asymmetric) or int4 (grouped, asymmetric) weights through NNCF."""
    try:
        import nncf
    except ImportError:
        raise ExportError("--weights int8/int4 needs nncf (pip install 'fleetgate[quantize]')") from None
    if weights == "int8":
        return nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters

    # a group must divide the input channels; a small model falls back to one group per channel, and
    # a layer whose channels the group does not divide (an MLP of 8/3 x hidden) gets a smaller group
    group = _INT4_GROUP if hidden_size % _INT4_GROUP == 0 else -1
    advanced = AdvancedCompressionParameters(group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST)
    try:
        return nncf.compress_weights(
            ov_model, mode=nncf.CompressWeightsMode.INT4_ASYM, group_size=group, ratio=1.0, advanced_parameters=advanced
        )
    except (nncf.InternalError, nncf.InvalidGroupSizeError) as exc:
        raise ExportError(f"int4 compression failed: {_one_line(exc)}") from None


def _tokenizers(ov: Any, transformers: Any, model: pathlib.Path, out: pathlib.Path) -> None:
    try:
        from openvino_tokenizers import convert_tokenizer
    except ImportError:
        raise ExportError("export-llm needs openvino-tokenizers (pip install 'fleetgate[openvino]')") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        encoder, decoder = convert_tokenizer(tokenizer, with_detokenizer=True)
    except Exception as exc:  # openvino_tokenizers raises plain exceptions for unsupported tokenizers
        raise ExportError(f"tokenizer conversion failed: {_one_line(exc)}") from None
    ov.save_model(encoder, out / "openvino_tokenizer.xml")
    ov.save_model(decoder, out / "openvino_detokenizer.xml")
