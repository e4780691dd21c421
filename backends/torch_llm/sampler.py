"""Choosing the next token: greedy, temperature, top-k, top-p, seeded per request.

Every sampled row draws its randomness from its own request's generator, one draw per generated
token, so a seeded request produces the same tokens whatever else shares the batch and even after a
preemption (already generated tokens are replayed, never re-drawn). Sampling uses the exponential
race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from backends.base import SamplingParams
from backends.torch_llm.structured.grammar import (
    CompiledGrammar,
    GrammarState,
    apply_grammars,
    prefetch_masks,
)


@dataclass
class SamplingState:
    """Per-request sampling parameters, the request's own random generator, and what the logit
    processors need (the prompt's tokens, the output's token counts, the stop tokens, the output's
    grammar)."""

    params: SamplingParams
    generator: torch.Generator | None  # None for greedy
    prompt_ids: frozenset[int] = frozenset()
    stop_ids: frozenset[int] = frozenset()
    counts: dict[int, int] = field(default_factory=dict)
    produced: int = 0
    #: the constraint's matcher (None: free text); advanced by `observe`
    grammar: GrammarState | None = None

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        device: torch.device,
        fallback_seed: int,
        prompt_ids: list[int] | None = None,
        stop_ids: frozenset[int] = frozenset(),
        grammar: CompiledGrammar | None = None,
        grammar_stop_ids: frozenset[int] = frozenset(),
    ) -> SamplingState:
        """`grammar` is `params.structured` compiled; the request gets a matcher of its own (so `n`
        choices of one prompt keep their own state), which only `grammar_stop_ids` (the end of
        sequence, never a request's stop ids) may end.

        Raises:
            ValueError: `grammar` given without `params.structured`, or missing with it.
        """
        if (grammar is None) != (params.structured is None):
            raise ValueError("a structured request needs its compiled grammar (and only it has one)")
        matcher = GrammarState(grammar, grammar_stop_ids) if grammar is not None else None
        seen = frozenset(prompt_ids or ()) if params.repetition_penalty != 1.0 else frozenset()
        gen = None
        if params.temperature > 0.0:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed if params.seed is not None else fallback_seed)
        return cls(params, gen, seen, stop_ids, grammar=matcher)

    @property
    def adjusts(self) -> bool:
        """Whether any logit processor applies to this request now."""
        p = self.params
        return bool(
            p.presence_penalty
            or p.frequency_penalty
            or p.repetition_penalty != 1.0
            or p.logit_bias
            or (self.produced < p.min_tokens and self.stop_ids)
        )

    def observe(self, token: int) -> None:
        """Count a generated token (the penalties look at the output so far) and move the grammar
        past it.

        Raises:
            RuntimeError: the grammar forbids the token.
        """
        self.produced += 1
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.grammar is not None:
            self.grammar.accept(token)

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:  # [V] -> [V], a new tensor
        p = self.params
        out = logits.clone()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(self.prompt_ids | self.counts.keys()), dtype=torch.long, device=out.device
            )
            if seen.numel():
                values = out[seen]
                out[seen] = torch.where(
                    values > 0, values / p.repetition_penalty, values * p.repetition_penalty
                )
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long, device=out.device)
            times = torch.tensor(list(self.counts.values()), dtype=out.dtype, device=out.device)
            out[ids] -= p.presence_penalty + p.frequency_penalty * times
        for token, bias in p.logit_bias.items():
            out[token] += bias
        if self.produced < p.min_tokens and self.stop_ids:
            out[torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=out.device)] = float("-inf")
        return out


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
    raw = logits
    grammars = [st.grammar for st in states]
    constrained = any(g is not None for g in grammars)
    adjusted = [st.adjusts for st in states]
    if any(adjusted) or (constrained and any(st.params.logprobs for st in states)):
        logits = logits.clone()  # processors and grammars work on a copy: logprobs read `raw`
    for row, st in enumerate(states):
        if adjusted[row]:
            logits[row] = st.adjusted(logits[row])
    if constrained:
        _constrain(raw, logits, grammars, adjusted)
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
    # the model's own distribution (before penalties and biases), as the alternatives are
    logprobs = torch.log_softmax(raw, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return token_list, logprobs.tolist()


def prefetch_grammar_masks(scheduled: list[tuple[Any, int]]) -> None:
    """Before a step's forward pass: start filling the masks of the constrained sequences it will
    sample (those whose last token it computes), see `prefetch_masks`."""
    prefetch_masks([
        seq.data.sampling.grammar for seq, n in scheduled
        if seq.data.sampling.grammar is not None and seq.num_computed_tokens + n == seq.num_tokens
    ])  # fmt: skip


def _constrain(
    raw: torch.Tensor, logits: torch.Tensor, grammars: list[GrammarState | None], adjusted: list[bool]
) -> None:
    """Mask what each row's grammar forbids. A processed row left with no token (min_tokens or a
    bias pushed every allowed one to -inf, say the end of a complete JSON value) takes the grammar's
    mask over the model's own logits: the grammar wins over the processors. [N, V] in place"""
    apply_grammars(logits, grammars)
    checked = [row for row, g in enumerate(grammars) if g is not None and adjusted[row]]
    if not checked:  # a grammar alone always leaves a token: no check, no device sync
        return
    dead = torch.isneginf(logits[checked].max(dim=-1).values).tolist()
    for row, is_dead in zip(checked, dead, strict=True):
        if is_dead:
            logits[row] = apply_grammars(raw[row : row + 1].clone(), [grammars[row]])[0]


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
