"""A running deployment: its backend, its fair queue and its labels, opened and closed together."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec
import structlog

from backends.base import Backend, Capability, as_generative, as_tensor
from backends.registry import create_backend
from backends.sources import ModelSources, SourceError
from gateway.config import Config, DeploymentConfig
from gateway.core.fleet.pending import PendingBackend, PendingFetch, localize
from gateway.observe import metrics
from policies.fair_queue import FairQueue, QueueSpec
from policies.fair_queue.spec import TENSOR_BURST_PER_SLOT
from router.health import CircuitBreakers
from router.load import ServiceTimes, expected_wait

log = structlog.get_logger(__name__)


def default_queue_spec(spec: DeploymentConfig) -> QueueSpec:
    """The queue when the config names none: wide enough that dynamic batching can fill batches."""
    if spec.queue is not None:
        return spec.queue
    if spec.batching is not None:
        return QueueSpec(max_concurrency=max(8, 2 * spec.batching.max_batch_size))
    if spec.backend in ("torch_llm", "openvino_llm", "remote"):
        return QueueSpec(max_concurrency=64)
    return QueueSpec(max_concurrency=8)


@dataclass
class Deployment:
    name: str
    spec: DeploymentConfig
    backend: Backend
    queue: FairQueue
    #: why it is not ready: the last load error, or while its model is fetched, the download's progress
    load_error: str | None = None
    #: its model addresses still to fetch into the cache (the backend is a stand-in until then)
    fetch: PendingFetch | None = None

    @property
    def ready(self) -> bool:
        return self.load_error is None and self.backend.ready

    @property
    def device(self) -> str:
        try:
            return self.backend.metadata().device
        except Exception:  # noqa: BLE001 - not loaded yet
            return self.spec.device or "unknown"

    @property
    def hardware(self) -> str:
        return self.spec.hardware or self.device

    def served_by(self) -> str:
        """Value of the `x-fleetgate-deployment` response header."""
        return f"{self.name}; backend={self.spec.backend}; device={self.device}; hardware={self.hardware}"


class FleetSignals:
    """What the router asks about deployments while it plans: health and expected wait.

    Built from the same live objects the core uses (deployments, breakers, service times), so the
    router needs no reference back to the core.
    """

    def __init__(
        self, deployments: Mapping[str, Deployment], breakers: CircuitBreakers, service_times: ServiceTimes
    ) -> None:
        self._deployments = deployments
        self._breakers = breakers
        self._service_times = service_times

    def is_healthy(self, deployment: str) -> bool:
        """Loaded, warmed up, and its circuit breaker lets requests through."""
        dep = self._deployments.get(deployment)
        return dep is not None and dep.ready and self._breakers.allows(deployment)

    def expected_wait(self, deployment: str) -> float:
        """Seconds until a new request would be done on `deployment` (see router.load)."""
        dep = self._deployments.get(deployment)
        if dep is None:
            return float("inf")
        queue = dep.queue
        return expected_wait(
            queue.depth(), queue.in_flight, queue.spec.max_concurrency, self._service_times.get(deployment)
        )


def _make_queue(
    spec: QueueSpec, weights: Mapping[str, float], backend: Backend, current: Callable[[], Backend] | None = None
) -> FairQueue:
    """The deployment's fair queue; for the LLM engine, gated on the engine's free sequence slots.

    Without the gate the engine's own (FCFS) waiting list would absorb the backlog and fairness
    between tenants would be lost. The engine's count is as of its last step, so it may admit a
    request or two early. An idle queue (nothing in flight) always dispatches, so a stale count can
    never stall it; every release re-checks the gate.
    """
    generative = Capability.GENERATE in backend.capabilities
    if spec.vtc_burst is None:  # the default burst credit: see QueueSpec.vtc_burst
        burst = 0.0 if generative else TENSOR_BURST_PER_SLOT * spec.max_concurrency
        spec = msgspec.structs.replace(spec, vtc_burst=burst)
    capacity = as_generative(backend).capacity if generative else None
    cell: list[FairQueue] = []
    if generative and current is not None:
        # the model is still being fetched: the engine (and its slots) arrives later, `current` finds it

        def gate() -> bool:
            live = as_generative(current()).capacity
            return live is None or cell[0].in_flight == 0 or live()[0] > 0

        cell.append(FairQueue(spec, weights=weights, capacity=gate))
        return cell[0]
    if capacity is None:
        return FairQueue(spec, weights=weights)
    queue = FairQueue(spec, weights=weights, capacity=lambda: cell[0].in_flight == 0 or capacity()[0] > 0)
    cell.append(queue)
    return queue


def build_deployments(config: Config, weights: Mapping[str, float]) -> dict[str, Deployment]:
    """Create (not load) every deployment. Raises ValueError naming the deployment's path.

    A deployment whose model addresses the cache does not hold yet gets a stand-in backend and is
    fetched when the deployments open (`open_deployments`), so the others serve meanwhile.
    """
    out: dict[str, Deployment] = {}
    sources = ModelSources(config.storage)
    for name, spec in config.deployments.items():
        local, fetch = localize(spec, sources)
        try:
            backend = PendingBackend(name, spec) if fetch is not None else create_backend(name, local)
        except ValueError as exc:
            raise ValueError(f"{exc} - at `$.deployments.{name}`") from None
        held: list[Deployment] = []
        current = (lambda held=held: held[0].backend) if fetch is not None else None
        queue = _make_queue(default_queue_spec(spec), weights, backend, current)
        dep = Deployment(name=name, spec=spec, backend=backend, queue=queue, fetch=fetch)
        dep.load_error = fetch.waiting if fetch is not None else None
        held.append(dep)
        out[name] = dep
    return out


#: first wait before a deployment that failed to load is tried again; doubled up to the cap
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


async def _fetch(dep: Deployment, fetch: PendingFetch) -> bool:
    """Bring a deployment's model files into the cache and build its backend; False (with
    `load_error` set to the one-line reason) when that failed."""

    def show(progress: str) -> None:
        dep.load_error = progress

    try:
        spec = await asyncio.to_thread(fetch.run, show)
        backend = create_backend(dep.name, spec)
    except asyncio.CancelledError:
        fetch.cancel()  # the download thread stops at its next chunk
        raise
    except (SourceError, ValueError) as exc:
        dep.load_error = f"fetch failed: {str(exc).splitlines()[0]}"
        log.error("deployment_fetch_failed", deployment=dep.name, backend=dep.spec.backend, error=dep.load_error)
        return False
    dep.backend, dep.fetch = backend, None
    return True


async def _open_one(dep: Deployment) -> bool:
    """Fetch (when its model is not cached), load and warm one deployment; False (with
    `load_error` set) when it failed."""
    started = time.perf_counter()
    if dep.fetch is not None and not await _fetch(dep, dep.fetch):
        return False
    try:
        await dep.backend.load()
        await dep.backend.warmup()
    except Exception as exc:  # noqa: BLE001 - reported, the gateway still serves the others
        dep.load_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.error(
            "deployment_load_failed", deployment=dep.name, backend=dep.spec.backend, error=dep.load_error
        )
        try:  # free what a half-done load holds before the next try
            await dep.backend.close()
        except Exception:  # noqa: BLE001 - best effort
            pass
        return False
    dep.load_error = None
    # Tensor backends with a batcher report batch sizes to the metrics.
    if Capability.TENSOR in dep.backend.capabilities:
        name = dep.name

        def observe(requests: int, rows: int) -> None:
            metrics.child(metrics.BATCH_SIZE, name).observe(rows)
            metrics.child(metrics.BATCH_REQUESTS, name).observe(requests)

        as_tensor(dep.backend).batch_observer = observe
    metrics.BACKEND_READY.labels(dep.name, dep.spec.backend, dep.device, dep.hardware).set(1)
    log.info(
        "deployment_ready",
        deployment=dep.name,
        backend=dep.spec.backend,
        device=dep.device,
        hardware=dep.hardware,
        load_s=round(time.perf_counter() - started, 3),
    )
    return True


async def _retry_until_loaded(dep: Deployment, first_s: float, max_s: float) -> None:
    """Try a failed deployment again with exponential backoff until it loads (or is cancelled)."""
    wait = first_s
    while True:
        await asyncio.sleep(wait)
        if await _open_one(dep):
            return
        wait = min(max_s, wait * 2)


class LoadRetries:
    """Background retries of the deployments that failed to load; cancelled when the gateway stops."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, dep: Deployment, first_s: float = RETRY_FIRST_S, max_s: float = RETRY_MAX_S) -> None:
        task = asyncio.create_task(_retry_until_loaded(dep, first_s, max_s), name=f"load-retry-{dep.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def open_deployments(deployments: Mapping[str, Deployment], retries: LoadRetries | None = None) -> None:
    """Load and warm every deployment concurrently; failures are recorded, not raised.

    With `retries`, each deployment that failed is tried again in the background (backoff from
    RETRY_FIRST_S to RETRY_MAX_S), so an upstream that is down at start-up is served once it is up.
    """
    deps = list(deployments.values())
    loaded = await asyncio.gather(*(_open_one(d) for d in deps))
    if retries is not None:
        for dep, ok in zip(deps, loaded, strict=True):
            if not ok:
                retries.start(dep)


async def close_deployments(deployments: Mapping[str, Deployment]) -> None:
    for dep in deployments.values():
        try:
            await dep.backend.close()
        except Exception as exc:  # noqa: BLE001 - closing must go on for the others
            log.warning("deployment_close_failed", deployment=dep.name, error=str(exc))
        metrics.BACKEND_READY.labels(dep.name, dep.spec.backend, dep.device, dep.hardware).set(0)
