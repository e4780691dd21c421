"""Write a tiny random-weight Llama-family model folder, built locally in a few seconds.

The folder looks like a Hugging Face checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template), so both this engine and `transformers` load it. The
byte-level BPE tokenizer is trained here, on generated text; nothing is downloaded.
"""

from __future__ import annotations

import json
import pathlib
import random
from typing import Any, Literal

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are were have has had not "
    "model token cache block batch queue tenant request stream server gateway engine prompt reply user "
    "assistant system hello world data time fast slow small large memory paged attention layer head "
    "one two three four five six seven eight nine ten red green blue cat dog bird tree river city "
    "what when where why how who which can will would should could may might must please thanks yes no"
).split()

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]


def _corpus(rng: random.Random, lines: int = 2000) -> list[str]:
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ",", ":"])
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)} é ü ß 日本 🙂"
        out.append(sentence)
    return out


def write_tokenizer(out_dir: pathlib.Path, vocab_size: int, seed: int) -> int:
    """Train a byte-level BPE tokenizer on generated text; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def write_tiny_llama(
    out_dir: pathlib.Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    pad_vocab_to: int | None = None,
    max_position_embeddings: int = 2048,
    architecture: Literal["llama", "qwen2", "mistral"] = "llama",
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    init_std: float = 0.02,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    seed: int = 0,
) -> pathlib.Path:
    """Write a random-weight model folder and return its path.

    Args:
        out_dir: folder to create (parents too); existing files are overwritten.
        architecture: "llama", "qwen2" (biases on q/k/v) or "mistral".
        rope_scaling: e.g. `{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}`.
        vocab_size: target vocabulary of the trained tokenizer (the small corpus may give fewer).
        pad_vocab_to: make the model's vocabulary (embedding and LM head) at least this large, e.g.
            32000 for realistic LM-head cost in benchmarks; the extra ids have no text.
        init_std: standard deviation of the random weights.
        dtype: dtype of the stored weights (and the config's dtype).
    """
    import torch
    from safetensors.torch import save_file

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = max(write_tokenizer(out_dir, vocab_size, seed), pad_vocab_to or 0)
    head_dim = hidden_size // num_heads
    inter = intermediate_size or hidden_size * 8 // 3
    arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    rope: dict[str, Any] = {"rope_theta": 10000.0, "rope_type": "default"}
    if rope_scaling:
        rope.update(rope_scaling)
    config = {
        "architectures": [arch_name[architecture]],
        "model_type": architecture,
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": inter,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": rope,
        "rope_scaling": rope if rope_scaling else None,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "dtype": dtype,
        "torch_dtype": dtype,
        "attention_bias": False,
        "sliding_window": None,
        "use_sliding_window": False,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * init_std).to(getattr(torch, dtype))

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=getattr(torch, dtype))

    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(vocab, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(q_out, hidden_size)
        w[p + "self_attn.k_proj.weight"] = rand(kv_out, hidden_size)
        w[p + "self_attn.v_proj.weight"] = rand(kv_out, hidden_size)
        w[p + "self_attn.o_proj.weight"] = rand(hidden_size, q_out)
        if architecture == "qwen2":
            w[p + "self_attn.q_proj.bias"] = rand(q_out)
            w[p + "self_attn.k_proj.bias"] = rand(kv_out)
            w[p + "self_attn.v_proj.bias"] = rand(kv_out)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden_size)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden_size)
        w[p + "mlp.down_proj.weight"] = rand(hidden_size, inter)
        w[p + "input_layernorm.weight"] = ones(hidden_size)
        w[p + "post_attention_layernorm.weight"] = ones(hidden_size)
    w["model.norm.weight"] = ones(hidden_size)
    if not tie_word_embeddings:
        w["lm_head.weight"] = rand(vocab, hidden_size)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out_dir / "model.safetensors"))
    return out_dir
