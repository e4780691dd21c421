"""Random LoRA adapters saved by PEFT itself, for the engine's and the gateway's LoRA tests."""

from __future__ import annotations

import pathlib


def write_peft_adapter(base: pathlib.Path, out: pathlib.Path, seed: int, **config: object) -> pathlib.Path:
    """A random (non-zero B) LoRA adapter for the model in `base`, written by `save_pretrained`."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **config))
    with torch.no_grad():  # PEFT's non-default init is tiny on B; scale it so outputs really change
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    lora.save_pretrained(str(out))
    return out
