"""Build the model from a local Hugging Face folder (config.json + *.safetensors); no hub access."""

from __future__ import annotations

import pathlib

import torch
from safetensors.torch import load_file

from backends.torch_llm.model.config import ModelConfig
from backends.torch_llm.model.llama import LlamaForCausalLM, rope_inv_freq

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(cfg: ModelConfig, override: str, device: torch.device) -> torch.dtype:
    """The compute dtype: the override, else the config's, with half precision kept off CPU float16."""
    name = cfg.dtype if override == "auto" else override
    dtype = DTYPES.get(name.removeprefix("torch."), torch.float32)
    # float16 matmuls on CPU are slow and partly unsupported; bfloat16 is the CPU half type.
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.bfloat16
    return dtype


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """An uninitialised model on `device` (weights allocated, not filled)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # Cast on the meta device first, so the weights are allocated once, in `dtype` (a float32 copy
    # of an 8B model would need 32 GB of device memory on the way).
    model = model.to(dtype).to_empty(device=device)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def load_model(folder: pathlib.Path, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Load config and weights from `folder`.

    Raises:
        FileNotFoundError: no config.json or no *.safetensors in the folder.
        ValueError: unsupported architecture, or weights missing / unexpected.
    """
    cfg = ModelConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder}")
    model = build_model(cfg, device, dtype)
    expected = set(model.state_dict())
    seen: set[str] = set()
    params = dict(model.named_parameters(remove_duplicate=False))
    for file in files:
        for name, tensor in load_file(str(file), device=str(device)).items():
            if name not in params:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ValueError(f"unexpected weight {name!r} in {file.name}")
            with torch.no_grad():
                params[name].copy_(tensor.to(dtype))
            seen.add(name)
    if cfg.tie_word_embeddings:
        seen.add("lm_head.weight")
    missing = expected - seen
    if missing:
        raise ValueError(f"weights missing from {folder}: {sorted(missing)[:5]}")
    return model
