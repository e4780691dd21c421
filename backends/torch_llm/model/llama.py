"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral) over a paged KV cache.

Parameter names match Hugging Face checkpoints, so a `model.safetensors` state dict loads as is.
Tokens of a step are one flattened batch `[T]` (no padding); `positions` gives each token's position
in its sequence. Computation mirrors the reference implementation op for op (RMSNorm in float32,
rotate-half rotary embeddings, residual adds), so float32 outputs match it token for token. On CPU
the elementwise chains between the matmuls may run as fused kernels (`use_fused_ops`,
`fused_cpu.py`): the same arithmetic in one pass each, the residual carried beside the hidden state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from backends.torch_llm.model.attention import AttentionMetadata, PagedAttention
from backends.torch_llm.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies `[D/2]`, with linear or Llama-3 scaling when the config asks for it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` `[T, heads, D]` at the positions `cos`/`sin` `[T, 1, D]` hold."""
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        # Set by the runner (`LlamaForCausalLM.set_attention`), which knows the device and the KV
        # pool's block size; a default here would silently read the pool with the wrong block size.
        self.attn: PagedAttention | None = None
        #: q, k and v as one projection (set by `packed_linear.fuse_projections`; then q/k/v_proj
        #: are None): one matmul instead of three, its output q, k and v of these sizes
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = (self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        fused: Any = None,  # the fused CPU kernels (`fused_cpu`), or None for torch ops
    ) -> torch.Tensor:
        t = x.shape[0]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            # q and k rotated together, as the heads of one view of the fused projection: half
            # the small elementwise ops of rotating each (the same arithmetic for every element)
            qkv = self.qkv_proj(x)
            qk_width = self.qkv_sizes[0] + self.qkv_sizes[1]
            qk = qkv[:, :qk_width].view(t, heads + kv_heads, d)
            if fused is not None:
                fused.rotary_(qkv, cos, sin, heads + kv_heads, d)  # in place, one pass: qk sees it
            else:
                qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]  # [T, H, D], [T, KVH, D]
            v = qkv[:, qk_width:].view(t, kv_heads, d)
        else:
            q = apply_rotary(self.q_proj(x).view(t, heads, d), cos, sin)
            k = apply_rotary(self.k_proj(x).view(t, kv_heads, d), cos, sin)
            v = self.v_proj(x).view(t, kv_heads, d)
        if self.attn is None:
            raise RuntimeError("no paged attention set: call LlamaForCausalLM.set_attention first")
        o = self.attn(q, k, v, kv[0], kv[1], meta)  # [T, H, D]
        return self.o_proj(o.reshape(t, heads * d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        #: gate and up as one projection (see Attention.qkv_proj)
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor, fused: Any = None) -> torch.Tensor:
        if self.gate_up_proj is not None and fused is not None:
            return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, kv, meta):  # noqa: ANN001, ANN201 - shapes as in Attention
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `logits` projects selected rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        #: the fused CPU kernels when `use_fused_ops` set them (None: torch ops throughout)
        self.fused_ops: Any = None

    def use_fused_ops(self, kernels: Any) -> None:
        """Run RMSNorm, the residual adds, rotary and SiLU-and-multiply as fused CPU kernels
        (`fused_cpu.cpu_kernels_or_none`); None returns to the torch ops."""
        self.fused_ops = kernels

    def set_attention(self, impl: PagedAttention) -> None:
        """Use `impl` in every layer (it is stateless across layers, so one instance is shared)."""
        for layer in self.model.layers:
            layer.self_attn.attn = impl

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        h = self.model.embed_tokens(input_ids)
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(h.dtype).unsqueeze(1)  # [T, 1, D]
        sin = emb.sin().to(h.dtype).unsqueeze(1)
        if self.fused_ops is not None:
            return self._forward_fused(h, cos, sin, kv_caches, meta)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv, meta)
        return self.model.norm(h)

    def _forward_fused(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The layers with the residual stream `residual` kept apart from the normalized input
        `x`: each residual add and the norm after it are one kernel (`add_rms_norm_`, in place),
        the same sums as `DecoderLayer.forward`'s `h + ...` followed by the next norm."""
        fused, layers = self.fused_ops, self.model.layers
        residual = h  # the embedding lookup's own tensor, updated in place from here
        first = layers[0].input_layernorm
        x = fused.rms_norm(h, first.weight, first.eps)
        for i, (layer, kv) in enumerate(zip(layers, kv_caches, strict=True)):
            attended = layer.self_attn(x, cos, sin, kv, meta, fused)
            post = layer.post_attention_layernorm
            fused.add_rms_norm_(attended, residual, post.weight, post.eps)
            x = layer.mlp(attended, fused)
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            fused.add_rms_norm_(x, residual, after.weight, after.eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        return self.lm_head(hidden).float()
