"""The parts of a Hugging Face `config.json` that the Llama-family model needs (pure Python)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

import msgspec

from backends.base import SamplingParams

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder.

    `qkv_bias` / `o_bias`: Qwen2 has biases on q/k/v only; Llama's `attention_bias` puts them on
    all four projections. `rope_scaling` keeps the config's own keys (`rope_type`, `factor`, ...).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    dtype: str = "float32"
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a `config.json` mapping (transformers 4.x and 5.x spellings).

        Raises:
            ValueError: for architectures or options this model does not implement.
        """
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (one of {sorted(SUPPORTED_MODEL_TYPES)})"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = _rope_parameters(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(raw.get("attention_bias", False))
        # Mistral sets a sliding window; Qwen2 only uses one when use_sliding_window is true.
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: pathlib.Path) -> ModelConfig:
        """`config.json`, with the end-of-sequence ids of `generation_config.json` added: models
        whose chat turns end with another token than the tokenizer's eos (Llama 3's `<|eot_id|>`)
        list it there, and generation must stop on either."""
        cfg = cls.from_dict(json.loads((folder / "config.json").read_text()))
        generation = folder / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *(int(i) for i in extra)]))
            cfg = dataclasses.replace(cfg, eos_token_ids=ids)
        return cfg


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5)."""
    params: dict[str, Any] = {}
    if "rope_theta" in raw:
        params["rope_theta"] = raw["rope_theta"]
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(raw.get(key), dict):
            params.update(raw[key])
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (one of {sorted(SUPPORTED_ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return params


#: generation_config.json keys -> SamplingParams fields a request may leave to the model
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}


def read_sampling_defaults(folder: pathlib.Path) -> dict[str, Any]:
    """The sampling defaults a checkpoint's `generation_config.json` declares (those we honour)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    out: dict[str, Any] = {}
    for key, name in _GENERATION_DEFAULTS.items():
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def with_model_defaults(sampling: SamplingParams, defaults: dict[str, Any]) -> SamplingParams:
    """`sampling` with the model's defaults filled in for the fields the caller left unset."""
    chosen = {k: v for k, v in defaults.items() if k in sampling.model_defaults}
    return msgspec.structs.replace(sampling, **chosen) if chosen else sampling
