"""LoRA adapters in PEFT's folder layout: read, check against the base model, keep on the host.

A PEFT LoRA folder holds `adapter_config.json` (rank, alpha, target modules, options) and
`adapter_model.safetensors` with, per adapted linear, `<prefix>.<module>.lora_A.weight` [r, in] and
`<prefix>.<module>.lora_B.weight` [out, r], where `<prefix>` is `base_model.model`. The adapted linear
computes `base(x) + lora_B(lora_A(x)) * scaling` (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA).

Everything that would make the served output differ from PEFT's is refused here, with the reason:
trained biases, `modules_to_save`, DoRA, fan-in/fan-out layouts, targets outside the decoder's seven
projections, shapes that do not fit the base, ranks over the deployment's maximum.
`inspect_adapter` checks all of that from the config and the safetensors header alone (no tensor is
read), so `fleetgate check-config` can refuse a bad adapter without loading a model.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

from backends.torch_llm.model.config import ModelConfig

#: the linear layers an adapter may target, by their name in the decoder layer
TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
_PREFIX = "base_model.model."
_KEY = re.compile(
    r"^(?P<module>model\.layers\.(?P<layer>\d+)\.(?P<part>self_attn|mlp)\.(?P<proj>\w+))\.lora_(?P<ab>[AB])\.weight$"
)
#: the decoder-layer part each projection lives in
_PART_OF = {p: "self_attn" for p in TARGETABLE[:4]} | {p: "mlp" for p in TARGETABLE[4:]}


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of every targetable projection, by its last name."""
    h, hd = cfg.hidden_size, cfg.head_dim
    return {
        "q_proj": (h, cfg.num_attention_heads * hd),
        "k_proj": (h, cfg.num_key_value_heads * hd),
        "v_proj": (h, cfg.num_key_value_heads * hd),
        "o_proj": (cfg.num_attention_heads * hd, h),
        "gate_proj": (h, cfg.intermediate_size),
        "up_proj": (h, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, h),
    }


@dataclass
class AdapterLayout:
    """What an adapter folder holds, checked against a base model: module path -> (rank, scaling)."""

    name: str
    folder: pathlib.Path
    modules: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def max_rank(self) -> int:
        return max(rank for rank, _ in self.modules.values())


@dataclass
class LoRAAdapter:
    """An adapter's weights on the host: module path -> (A [r, in], B [out, r], scaling)."""

    name: str
    folder: pathlib.Path
    weights: dict[str, tuple[Any, Any, float]]

    @property
    def max_rank(self) -> int:
        return max(a.shape[0] for a, _, _ in self.weights.values())

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b, _ in self.weights.values())


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override (`rank_pattern` / `alpha_pattern`): a key matches a module path
    when the path ends with it at a dot boundary (the key is a regular expression)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(folder: pathlib.Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"no {CONFIG_FILE} in {folder} (a PEFT LoRA adapter folder holds one)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    kind = str(raw.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise ValueError(f"{path}: peft_type {kind!r} is not served; only LORA adapters are")
    refusals = [
        (raw.get("use_dora"), "DoRA adapters (use_dora) are not served"),
        (raw.get("fan_in_fan_out"), "fan_in_fan_out layouts (GPT-2 Conv1D) are not served"),
        (raw.get("modules_to_save"), "modules_to_save (fully trained layers) are not served"),
        (raw.get("bias", "none") != "none", "adapters with trained biases (bias != none) are not served"),
    ]
    for present, why in refusals:
        if present:
            raise ValueError(f"{path}: {why}")
    return raw


def inspect_adapter(
    name: str, folder: str | pathlib.Path, base: ModelConfig, *, max_rank: int
) -> AdapterLayout:
    """Check an adapter folder against the base model without reading its tensors.

    Raises:
        ValueError: with the reason: missing files, an unsupported PEFT option, a module the engine
            cannot adapt, shapes that do not match the base (another base model), a rank above
            `max_rank`.
    """
    folder = pathlib.Path(folder)
    raw = _read_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"no {WEIGHTS_FILE} in {folder} (save the adapter with safe_serialization)")
    alpha = _number(raw.get("lora_alpha", raw.get("r", 8)), f"{folder / CONFIG_FILE}: lora_alpha")
    rslora = bool(raw.get("use_rslora", False))
    alpha_pattern = raw.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict):
        raise ValueError(
            f"{folder / CONFIG_FILE}: alpha_pattern must be a mapping of module patterns to numbers"
        )
    shapes = linear_shapes(base)
    pairs = _pair_weights(weights, base)
    layout = AdapterLayout(name, folder)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{weights}: {module} has lora_{next(iter(ab))} without its other half")
        a_shape, b_shape = ab["A"], ab["B"]
        in_f, out_f = shapes[module.rsplit(".", 1)[1]]
        rank = a_shape[0] if len(a_shape) == 2 else 0
        if (
            rank < 1
            or len(a_shape) != 2
            or len(b_shape) != 2
            or a_shape[1] != in_f
            or b_shape != (out_f, rank)
        ):
            raise ValueError(
                f"{weights}: {module} has A {list(a_shape)} and B {list(b_shape)}, the base needs "
                f"A [r, {in_f}] and B [{out_f}, r]: this adapter was trained for another base"
            )
        if rank > max_rank:
            raise ValueError(
                f"adapter {name!r}: rank {rank} of {module} is above this deployment's max_lora_rank "
                f"of {max_rank} (raise options.max_lora_rank)"
            )
        try:
            module_alpha = _number(_pattern_value(alpha_pattern, module, alpha), f"alpha_pattern of {module}")
        except re.error as exc:
            raise ValueError(
                f"{folder / CONFIG_FILE}: alpha_pattern holds an invalid pattern ({exc})"
            ) from None
        scaling = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        layout.modules[module] = (rank, scaling)
    return layout


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _tensor_shapes(weights: pathlib.Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a safetensors file, from its header alone."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{weights}: not a readable safetensors file ({exc})") from None


def _pair_weights(weights: pathlib.Path, base: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Module path -> {"A": shape, "B": shape}, refusing weights that are not the decoder's LoRA."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in _tensor_shapes(weights).items():
        m = _KEY.match(key.removeprefix(_PREFIX))
        if m is None or m["proj"] not in _PART_OF or _PART_OF[m["proj"]] != m["part"]:
            raise ValueError(
                f"{weights}: weight {key!r} is not a LoRA weight of the decoder's projections "
                f"({', '.join(TARGETABLE)})"
            )
        if int(m["layer"]) >= base.num_hidden_layers:
            raise ValueError(
                f"{weights}: layer {m['layer']} does not exist in the base model "
                f"({base.num_hidden_layers} layers): this adapter was trained for another base"
            )
        pairs.setdefault(m["module"], {})[m["ab"]] = shape
    if not pairs:
        raise ValueError(f"{weights}: holds no LoRA weights")
    return pairs


def load_adapter(
    name: str, folder: str | pathlib.Path, base: ModelConfig, *, max_rank: int, dtype: Any
) -> LoRAAdapter:
    """Check (`inspect_adapter`) and read an adapter's weights into host memory, in `dtype`."""
    from safetensors.torch import load_file

    layout = inspect_adapter(name, folder, base, max_rank=max_rank)
    tensors = load_file(str(layout.folder / WEIGHTS_FILE), device="cpu")
    weights = {}
    for module, (_, scaling) in layout.modules.items():
        a = tensors[f"{_PREFIX}{module}.lora_A.weight"].to(dtype).contiguous()
        b = tensors[f"{_PREFIX}{module}.lora_B.weight"].to(dtype).contiguous()
        weights[module] = (a, b, scaling)
    return LoRAAdapter(name, layout.folder, weights)
