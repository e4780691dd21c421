"""One request's token state, as the scheduler and block manager see it (pure Python)."""

from __future__ import annotations

import enum
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids of one request plus how many of them already have KV in the cache.

    `num_computed_tokens` counts tokens whose keys/values are in the cache (prefix-cache hits
    included). A sequence needs a forward pass over `num_tokens - num_computed_tokens` tokens;
    when that reaches zero after a step, the engine samples its next token. Preemption by recompute
    simply drops the blocks and resets `num_computed_tokens` to 0: the prompt and the tokens
    generated so far are replayed as one longer prompt.

    Attributes:
        seq_id: engine-unique integer id (arrival order, used for FCFS).
        request_id: the caller's id.
        prompt_token_ids: the prompt.
        output_token_ids: tokens generated so far.
        max_tokens: most tokens to generate.
        cache_scope: prefix-cache namespace (the tenant, or "" when shared globally).
        adapter: the LoRA adapter this request runs with (None: the base model).
        arrival_time: clock reading when the request was added.
        block_table: KV block ids, in order; block i holds token positions [i*bs, (i+1)*bs).
        block_hashes: chained hashes of the full blocks registered for prefix caching.
        num_cached_tokens: prompt tokens served from the prefix cache at the last admission.
        cached_prompt_tokens: prompt tokens the prefix cache served at the first admission (None
            until then): what the request reports and is priced as cached. A preempted request's
            readmission finds its own blocks again, which saved nothing the first admission computed.
        num_preemptions: how many times this sequence was preempted.
        data: the engine's per-request payload (sampling state, detokenizer); opaque here.
    """

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int,
        cache_scope: str = "",
        arrival_time: float = 0.0,
        data: Any = None,
        adapter: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.cache_scope = cache_scope
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_cached_tokens = 0
        self.cached_prompt_tokens: int | None = None
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.data = data
        self.adapter = adapter

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int = 0, stop: int | None = None) -> list[int]:
        """Prompt and output tokens in positions [start, stop)."""
        stop = self.num_tokens if stop is None else stop
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
