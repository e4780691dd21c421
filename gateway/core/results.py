"""What the pipeline hands back to the protocol adapters: named results, one per entry point.

An adapter decodes its wire request, calls one entry of `GatewayCore`, and encodes one of these.
Every field says what it holds, so an adapter never reaches into the core for more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from backends.base import GenerateRequest, ModelMetadata, TensorRequest, TensorResponse
from gateway.core.calls import Call, ModelRef
from gateway.core.deadline import Deadline
from gateway.core.fleet.deployments import Deployment
from gateway.core.streams import GenerationStream
from router.planner import Plan


@dataclass
class Served:
    """Who served a call, and the headers (or gRPC trailing metadata) its answer carries."""

    #: None for a graph, whose steps each have theirs (`description` names them)
    deployment: Deployment | None
    #: the routing decision the call was served under
    plan: Plan
    #: admission headers (x-ratelimit-*, quotas) to send with the answer
    headers: dict[str, str] = field(default_factory=dict)
    #: a graph's steps and the deployments that served them (empty for one deployment)
    description: str = ""

    def response_headers(self, call: Call) -> dict[str, str]:
        """The admission headers plus the deployment that served and the call's request id."""
        served_by = self.deployment.served_by() if self.deployment is not None else self.description
        return {**self.headers, "x-fleetgate-deployment": served_by, "x-request-id": call.echo_id}


class DecodedTensors(Protocol):
    """What an adapter's tensor loader returns: its decoded payload, carrying the internal request."""

    @property
    def request(self) -> TensorRequest: ...


D = TypeVar("D", bound=DecodedTensors)


@dataclass
class TensorOutcome(Generic[D]):
    """A served tensor call: the adapter's decoded payload (for encoding), the answer, who served."""

    decoded: D
    response: TensorResponse
    served: Served


@dataclass
class GenerationInput:
    """What an adapter's generation loader returns: the model named in the payload, and how to
    build the internal request (built after routing, so an unknown model is refused first)."""

    model: ModelRef
    build: Callable[[], GenerateRequest]
    #: the decoded payload, handed back to the adapter for encoding
    body: Any = None
    #: choices to generate for the same prompt (OpenAI `n`), admitted together
    n: int = 1


class NamesModel(Protocol):
    """A decoded payload that names its model (generation and embeddings inputs)."""

    @property
    def model(self) -> ModelRef: ...


P = TypeVar("P", bound=NamesModel)


@dataclass
class StartedGeneration:
    """A started generation: its events (iterate to the end or `aclose()`), who serves it, the
    payload the adapter decoded, and the call's deadline for waiting on each event."""

    stream: GenerationStream
    served: Served
    body: Any
    deadline: Deadline
    #: every choice's stream (OpenAI `n`); `stream` is the first
    streams: list[GenerationStream] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.streams:
            self.streams = [self.stream]


@dataclass
class EmbeddingsInput:
    """What an adapter's embeddings loader returns: the model, the inputs, the decoded payload."""

    model: ModelRef
    inputs: list[str] | list[list[int]]
    body: Any = None
    #: keep the first N components of each vector (checked against the model before admission)
    dimensions: int | None = None


@dataclass
class EmbeddingsOutcome:
    """A served embeddings call: one vector per input, the tokens it cost, who served it."""

    vectors: np.ndarray
    tokens: int
    served: Served
    body: Any


@dataclass
class ModelView:
    """What metadata and readiness endpoints show of a model, for one caller."""

    name: str
    version: str | None
    versions: list[str]
    #: the deployment that would serve (None for a graph: `describe` derives its metadata)
    deployment: Deployment | None
    #: whether any deployment of the plan can take a request now
    ready: bool
    describe: Callable[[], ModelMetadata] | None = None

    def metadata(self) -> ModelMetadata:
        """The serving deployment's metadata (raises BackendUnavailable before it is loaded)."""
        if self.describe is not None:
            return self.describe()
        assert self.deployment is not None
        return self.deployment.backend.metadata()
