"""Choosing the next token: greedy, temperature, top-k, top-p, seeded per request.

Every sampled row draws its randomness from its own request's generator, one draw per generated
token, so a seeded request produces the same tokens whatever else shares the batch and even after a
preemption (already generated tokens are replayed, never re-drawn). Sampling uses the exponential
race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.base import SamplingParams


@dataclass
class SamplingState:
    """Per-request sampling parameters and the request's own random generator."""

    params: SamplingParams
    generator: torch.Generator | None  # None for greedy

    @classmethod
    def create(cls, params: SamplingParams, device: torch.device, fallback_seed: int) -> SamplingState:
        if params.temperature <= 0.0:
            return cls(params, None)
        gen = torch.Generator(device=device)
        gen.manual_seed(params.seed if params.seed is not None else fallback_seed)
        return cls(params, gen)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:  # [V] -> [V]
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the best one always stays).
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor, states: list[SamplingState]
) -> tuple[list[int], list[float] | None]:  # logits [N, V] float32
    """Pick one token per row; also the log-probability of each chosen token (raw model distribution).

    Returns:
        (token ids, logprobs or None when no row asked for them).
    """
    tokens = torch.argmax(logits, dim=-1)  # greedy for everyone first, one batched op
    for row, st in enumerate(states):
        if st.generator is None:
            continue
        p = st.params
        scaled = _filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = scaled.softmax(-1)
        race = torch.empty_like(probs).exponential_(generator=st.generator)
        tokens[row] = torch.argmax(probs / race)
    token_list = tokens.tolist()
    if not any(st.params.logprobs for st in states):
        return token_list, None
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return token_list, logprobs.tolist()


def top_logprobs(logits: torch.Tensor, states: list[SamplingState]) -> list[list[tuple[int, float]]] | None:
    """Per row, the `top_logprobs` most likely tokens and their log-probabilities (raw model
    distribution, like the chosen token's), or None when no row asked for alternatives."""
    k = max((st.params.top_logprobs for st in states if st.params.logprobs), default=0)
    if k <= 0:
        return None
    values, ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    out = []
    for row, st in enumerate(states):
        n = st.params.top_logprobs if st.params.logprobs else 0
        out.append(list(zip(ids[row, :n].tolist(), values[row, :n].tolist(), strict=True)))
    return out
