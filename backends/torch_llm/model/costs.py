"""Bytes a decode step must read, from a model config alone (pure Python; used by the benchmarks).

A decode step is memory-bound at small batch: every weight is read once per step (the embedding table
excepted: only the rows of the step's tokens are read; with tied embeddings the same matrix is read in
full as the LM head), plus every key and value of every sequence's context. Dividing a device's
measured copy bandwidth by these bytes gives the step rate the device cannot beat.
"""

from __future__ import annotations

from backends.torch_llm.model.config import ModelConfig


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the model (a tied LM head counted once), matching `LlamaForCausalLM`."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = h * q_out + 2 * h * kv_out + q_out * h
    attn += (q_out + 2 * kv_out) * cfg.qkv_bias + h * cfg.o_bias
    mlp = 3 * h * cfg.intermediate_size + (2 * cfg.intermediate_size + h) * cfg.mlp_bias
    layer = attn + mlp + 2 * h  # + two RMSNorm weights
    embed = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.num_hidden_layers * layer + embed + head + h  # + final norm


def weight_bytes_per_step(cfg: ModelConfig, elem_bytes: int) -> int:
    """Weight bytes one forward step reads (all parameters but the embedding table's unread rows)."""
    unread_embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (parameter_count(cfg) - unread_embedding) * elem_bytes


def kv_bytes_per_token(cfg: ModelConfig, elem_bytes: int) -> int:
    """Bytes of keys + values one token occupies across all layers."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem_bytes


def decode_bytes_per_step(cfg: ModelConfig, elem_bytes: int, context_lens: list[int]) -> int:
    """Bytes one decode step over sequences with these context lengths reads (weights + KV)."""
    return weight_bytes_per_step(cfg, elem_bytes) + sum(context_lens) * kv_bytes_per_token(cfg, elem_bytes)
