"""The `queue:` section of a deployment: which fair-queue policy runs and how big the queues are."""

from __future__ import annotations

import math
from typing import Literal

from fleetgate.spec import SpecBase

PolicyName = Literal["fcfs", "vtc", "drr"]
POLICY_NAMES: frozenset[str] = frozenset({"fcfs", "vtc", "drr"})


#: the default VTC burst credit of a tensor deployment, in rows per slot: with it a quiet tenant's
#: p99 under a flood of twice capacity stayed within 1.5x of its no-flood p99 (1.40x / 1.34x;
#: plain VTC 2.8x), at 1.03x FCFS's throughput (bench/bench_fairness_gateway.py, ORT, one slot)
TENSOR_BURST_PER_SLOT = 32.0


class QueueSpec(SpecBase):
    """Admission queue of one deployment.

    Attributes:
        policy: order in which backlogged tenants are served: `fcfs` (arrival order), `vtc`
            (weighted Virtual Token Counter, Sheng et al. OSDI 2024) or `drr` (deficit round robin).
        max_concurrency: requests dispatched to the backend at once (the default capacity gate;
            with a custom capacity callable both must allow a dispatch).
        max_queue_per_tenant: queued requests of one tenant; beyond it the tenant gets 429.
        max_queue_total: queued requests of the whole deployment; beyond it callers get 503.
        default_deadline_s: how long a request may wait in the queue when the caller gives no
            deadline; None waits forever.
        drr_quantum: cost units a tenant's deficit grows by per round (times its weight) under
            `drr`; set it near the cost of a typical request.
        vtc_burst: under `vtc`, cost units of unused share a tenant that returns from idle may
            keep (a token bucket refilled at its fair share); 0 is the paper's lift to the
            minimum. About `max_concurrency` x a typical request's cost lets a quiet tenant's
            short burst through ahead of a flood; a newcomer's lead grows by at most this much.
            None (the default): the gateway picks `TENSOR_BURST_PER_SLOT` x `max_concurrency` rows
            for tensor deployments (measured: bench/results/fairness_gateway_ort.json) and 0 for
            text generation, whose costs are tokens.
        split_rows: a tensor request with more rows than this runs as several runtime calls of at
            most this many rows, each taking its own turn in the queue: a quiet tenant's request
            waits behind one slice of a large request, not the whole of it. Only for models whose
            rows are independent (every input and output batched along dimension 0); None: off.
        background_max_in_flight: background requests (batch jobs) dispatched at once while
            interactive traffic is present (a request in flight, or one seen in the last
            `background_idle_s`). Background requests only ever take capacity no interactive
            request waits for; this bounds how much of the backend they share with interactive
            ones (a continuous-batching engine runs them in the same steps).
        background_idle_s: after this long without interactive traffic, background requests may
            fill `max_concurrency - 1` slots (one is kept for the next interactive arrival).
    """

    policy: PolicyName = "vtc"
    max_concurrency: int = 4
    max_queue_per_tenant: int = 256
    max_queue_total: int = 4096
    default_deadline_s: float | None = None
    drr_quantum: float = 16.0
    vtc_burst: float | None = None
    split_rows: int | None = None
    background_max_in_flight: int = 1
    background_idle_s: float = 1.0

    def background_limit(self, interactive_present: bool) -> int:
        """Background requests allowed in flight (see `background_max_in_flight`)."""
        if interactive_present:
            return self.background_max_in_flight
        return max(self.background_max_in_flight, self.max_concurrency - 1)

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {sorted(POLICY_NAMES)}, got {self.policy!r}")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.max_queue_per_tenant < 1:
            raise ValueError("max_queue_per_tenant must be >= 1")
        if self.max_queue_total < 1:
            raise ValueError("max_queue_total must be >= 1")
        if self.default_deadline_s is not None and not (
            math.isfinite(self.default_deadline_s) and self.default_deadline_s > 0
        ):
            raise ValueError("default_deadline_s must be a finite number > 0 (or null)")
        if not (math.isfinite(self.drr_quantum) and self.drr_quantum > 0):
            raise ValueError("drr_quantum must be a finite number > 0")
        if self.vtc_burst is not None and not (math.isfinite(self.vtc_burst) and self.vtc_burst >= 0):
            raise ValueError("vtc_burst must be a finite number >= 0")
        if self.background_max_in_flight < 1:
            raise ValueError("background_max_in_flight must be >= 1")
        if not (math.isfinite(self.background_idle_s) and self.background_idle_s >= 0):
            raise ValueError("background_idle_s must be a finite number >= 0")
        if self.split_rows is not None and self.split_rows < 1:
            raise ValueError("split_rows must be >= 1 (or null)")
