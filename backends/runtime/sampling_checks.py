"""The ranges of OpenAI's sampling fields, checked the same way by every own LLM engine (torch_llm,
openvino_llm), so a request out of range gets one message naming the field whichever engine serves it."""

from __future__ import annotations

from backends.base import SamplingParams
from backends.errors import InvalidInput


def check_sampling_ranges(p: SamplingParams) -> None:
    """Raise InvalidInput naming the first sampling field out of its range (the seed is the
    engine's own concern: its generator decides which seeds it takes)."""
    checks = [
        ("max_tokens", p.max_tokens >= 1, "must be >= 1"),
        ("temperature", p.temperature >= 0.0, "must be >= 0"),
        ("top_p", 0.0 < p.top_p <= 1.0, "must be in (0, 1]"),
        ("top_k", p.top_k >= 0, "must be >= 0"),
        ("top_logprobs", 0 <= p.top_logprobs <= 20, "must be in 0..20"),
        ("presence_penalty", -2.0 <= p.presence_penalty <= 2.0, "must be in -2..2"),
        ("frequency_penalty", -2.0 <= p.frequency_penalty <= 2.0, "must be in -2..2"),
        ("repetition_penalty", 0.0 < p.repetition_penalty <= 10.0, "must be in (0, 10]"),
        ("min_tokens", 0 <= p.min_tokens <= p.max_tokens, "must be in 0..max_tokens"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise InvalidInput(f"{name} {why}")
