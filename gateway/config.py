"""The gateway's configuration: YAML decoded into msgspec Structs, checked once at start-up.

Every problem is reported as one `ConfigError` line naming the path in the file, e.g.
`Expected `int`, got `str` - at `$.server.port``. Relative paths in the file (model files, the
SQLite state file) are resolved against the directory of the config file, so a config works
whatever directory fleetgate is started from.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from backends.base import ModelMetadata
from backends.signatures import read_signature
from backends.spec import DeploymentSpec, SpecBase, with_choices
from gateway import config_checks
from gateway.batches.config import BatchesConfig
from gateway.config_checks import ConfigError, yaml_error
from policies.fair_queue import QueueSpec
from policies.types import TenantSpec
from router.graph_types import check_graph_tensors
from router.graphs import GraphConfig, check_graph
from router.spec import BreakerConfig, ModelConfig


class ServerConfig(SpecBase):
    #: address the HTTP port (and the gRPC port) listens on; `0.0.0.0` for every interface
    host: str = "127.0.0.1"
    #: the HTTP port (`fleetgate serve --port` overrides it); 0 picks a free one
    port: int = 8000
    #: largest request body (and gRPC message) accepted; a larger one is refused with 413
    max_body_bytes: int = 16 * 1024 * 1024
    #: a request not finished this long after it arrived is answered 504 (end-to-end deadline)
    request_timeout_s: float = 120.0
    #: the least severe log lines written (JSON lines on stdout)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: when /health/ready and /v2/health/ready answer 200: `any` deployment can serve (the default:
    #: one broken upstream must not take the whole gateway out of a load balancer), or `all` are loaded
    readiness: Literal["any", "all"] = "any"
    #: gateway processes on this port (see gateway/serve/workers.py); > 1 needs a shared (sqlite/redis) state
    workers: int = 1
    #: open connections beyond this get 503 at once (a flood of idle or slow clients cannot pile up)
    max_connections: int = 2048
    #: after SIGTERM, connections still open after this long are closed (slow clients included);
    #: the drain timeout unless `drain_timeout_s` is set
    graceful_shutdown_s: float = 30.0
    #: after SIGTERM, requests keep being served this long while readiness already says 503 (load
    #: balancers need time to notice); then new requests get 503 + Retry-After (gateway/serve/drain.py)
    drain_grace_s: float = 5.0
    #: after the grace, requests in flight and open streams may run this long before they are
    #: cancelled (their reservations released); default: `graceful_shutdown_s`
    drain_timeout_s: float | None = None
    #: a connection whose request headers are not all in after this long is closed (httptools server;
    #: on the gRPC port: a connection that has not sent its HTTP/2 preface and SETTINGS)
    header_timeout_s: float = 10.0
    #: a new connection that has sent no byte after this long is closed, so sockets opened and left
    #: silent cannot hold `max_connections` (httptools server; per connection, from its opening)
    first_byte_timeout_s: float = 5.0
    #: open connections one client address may hold in each gateway process (an IPv6 /64 counts as
    #: one address; `trusted_proxies` are not capped); beyond, a new one gets 503 and is closed
    max_connections_per_client: int = 256
    #: a second port answering only /health/live, /health/ready and /v2/health/{live,ready}, on
    #: `host`, outside every connection cap (a flood of the main port cannot fail the probes); point
    #: Kubernetes probes here and keep it off the public network. null (the default): off
    health_port: int | None = None
    #: reverse proxies (addresses or CIDR networks, `*` for any) whose X-Forwarded-For and
    #: X-Forwarded-Proto are believed: the client address (admin lockout, logs) is the one they
    #: name. Empty (the default): forwarded headers are ignored and the peer is the client
    trusted_proxies: tuple[str, ...] = ()
    #: the gRPC front door (KServe v2 / Triton and TF Serving services, health, reflection) on the
    #: same host; null turns it off; `auto` (the default) is `port + 1` (8001 beside 8000, and it
    #: moves with `--port`). Omitted: `FLEETGATE_GRPC_PORT` when set (a number, or `off`).
    #: Messages may be as large as `max_body_bytes`.
    grpc_port: int | Literal["auto"] | None = "auto"
    #: open gRPC connections beyond this are closed as they are accepted (one HTTP/2 connection
    #: carries many calls, so a client needs few); a connection that has not sent its HTTP/2
    #: preface within `header_timeout_s` is closed too, so idle sockets cannot hold the slots
    grpc_max_connections: int = 1024
    #: a gRPC connection with no call in flight for this long is closed (GOAWAY; clients reconnect)
    grpc_idle_timeout_s: float = 300.0
    #: gRPC calls in progress at once; one more is answered RESOURCE_EXHAUSTED at once
    grpc_max_concurrent_rpcs: int = 2048

    @property
    def grpc_listen_port(self) -> int | None:
        """The gRPC port to bind (`auto`: the HTTP port + 1), or None when gRPC is off."""
        if self.grpc_port == "auto":
            return self.port + 1 if 0 < self.port < 65535 else 0
        return self.grpc_port

    @property
    def shutdown_timeout_s(self) -> float:
        """How long requests in flight may run after SIGTERM's grace (drain timeout)."""
        return self.graceful_shutdown_s if self.drain_timeout_s is None else self.drain_timeout_s

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in 0..65535")
        if isinstance(self.grpc_port, int) and not 0 <= self.grpc_port <= 65535:
            raise ValueError("grpc_port must be in 0..65535, auto, or null")
        if self.port != 0 and self.grpc_port not in (None, 0) and self.grpc_listen_port == self.port:
            raise ValueError("grpc_port must differ from port")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if not 1 <= self.workers <= 256:
            raise ValueError("workers must be in 1..256")
        for name in ("max_connections", "grpc_max_connections", "grpc_max_concurrent_rpcs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        # durations: finite, and > 0 where zero would mean "never wait at all"
        for name, minimum_excluded in (
            ("request_timeout_s", True),
            ("graceful_shutdown_s", False),
            ("drain_grace_s", False),
            ("drain_timeout_s", False),
            ("header_timeout_s", True),
            ("grpc_idle_timeout_s", True),
        ):
            value = getattr(self, name)
            if value is None:  # drain_timeout_s: unset means graceful_shutdown_s
                continue
            if not math.isfinite(value) or value < 0 or (minimum_excluded and value == 0):
                raise ValueError(f"{name} must be a finite number {'>' if minimum_excluded else '>='} 0")
        self._check_front_door()

    def _check_front_door(self) -> None:
        """The main port's connection limits, the health port and the trusted proxies."""
        if not (math.isfinite(self.first_byte_timeout_s) and self.first_byte_timeout_s > 0):
            raise ValueError("first_byte_timeout_s must be a finite number > 0")
        if self.max_connections_per_client < 1:
            raise ValueError("max_connections_per_client must be >= 1")
        self._check_health_port()
        self._check_trusted_proxies()

    def _check_health_port(self) -> None:
        if self.health_port is None:
            return
        if not 0 <= self.health_port <= 65535:
            raise ValueError("health_port must be in 0..65535, or null")
        if self.health_port != 0 and self.health_port in (self.port, self.grpc_listen_port):
            raise ValueError("health_port must differ from port and grpc_port")

    def _check_trusted_proxies(self) -> None:
        import ipaddress

        for proxy in self.trusted_proxies:
            if proxy == "*":
                continue
            try:
                ipaddress.ip_network(proxy)
            except ValueError:
                raise ValueError(
                    f"trusted_proxies: {proxy!r} is not an address or a network (10.0.0.0/8, ::1, *)"
                ) from None


class StateConfig(SpecBase):
    #: memory:// | sqlite:///path | redis://host:port/db
    url: str = "sqlite:///./var/fleetgate.db"
    #: when the store cannot be reached, keep admitting on this replica's local state for this many
    #: seconds before refusing (503); 0, the default, fails closed at once
    fail_open_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("memory://", "sqlite:///", "redis://", "rediss://")):
            raise ValueError("url must start with memory://, sqlite:///, redis:// or rediss://")


class TracingConfig(SpecBase):
    """OpenTelemetry traces (`fleetgate[tracing]`) through the OpenTelemetry SDK: one trace per request.

    A field set here wins; a field left unset (None) takes the standard `OTEL_*` variable, then the
    SDK's default (docs/tracing.md)."""

    #: off by default: no span is made and nothing is imported
    enabled: bool = False
    #: the collector's traces URL (OTLP/HTTP: ending in /v1/traces); unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    #: then OTEL_EXPORTER_OTLP_ENDPOINT (plus /v1/traces for HTTP), then http://localhost:4318/v1/traces
    otlp_endpoint: str | None = None
    #: "http/protobuf" or "grpc" (needs opentelemetry-exporter-otlp-proto-grpc); unset:
    #: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, then OTEL_EXPORTER_OTLP_PROTOCOL, then http/protobuf
    protocol: Literal["http/protobuf", "grpc"] | None = None
    #: headers sent with every export (a collector's key: "${COLLECTOR_KEY}"); unset:
    #: OTEL_EXPORTER_OTLP_TRACES_HEADERS, then OTEL_EXPORTER_OTLP_HEADERS
    headers: dict[str, str] | None = None
    #: the resource's service.name; unset: OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES), then "fleetgate"
    service_name: str | None = None
    #: fraction of traces kept when the client sent no sampling decision: the sampler is
    #: ParentBased(TraceIdRatioBased(sample_ratio)); unset: OTEL_TRACES_SAMPLER and
    #: OTEL_TRACES_SAMPLER_ARG, then parentbased_always_on (every trace)
    sample_ratio: float | None = None
    #: also a span per gateway step (authenticate, route, admit, queue) under each request, for a
    #: closer look during an incident; off, a request has its root span and one per backend attempt
    step_spans: bool = False
    #: ended spans are sent every this many seconds, or sooner once `export_batch_size` wait
    export_interval_s: float = 1.0
    #: most spans in one export
    export_batch_size: int = 2048
    #: spans waiting past this (the collector slow or down) are dropped, never held
    max_queued_spans: int = 20_000

    def __post_init__(self) -> None:
        if self.sample_ratio is not None and not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError("sample_ratio must be in 0..1")
        if not self.export_interval_s > 0:
            raise ValueError("export_interval_s must be > 0")
        if not 1 <= self.export_batch_size <= self.max_queued_spans:
            raise ValueError("export_batch_size must be >= 1 and at most max_queued_spans")
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError("otlp_endpoint must be an http:// or https:// URL")


class AdminConfig(SpecBase):
    #: environment variable holding the admin API bearer key (also the console's sign-in, /admin/ui);
    #: no variable set = admin API and console off
    key_env: str = "FLEETGATE_ADMIN_KEY"
    #: environment variable holding a key that reads /metrics and readiness detail (and nothing else)
    metrics_key_env: str = "FLEETGATE_METRICS_KEY"
    #: serve /metrics without a key: only where the port is reachable by the operator alone
    public_metrics: bool = False
    #: wrong admin keys one client address may present per minute; beyond, its admin calls get 429
    max_failures_per_minute: int = 30

    def __post_init__(self) -> None:
        if self.max_failures_per_minute < 1:
            raise ValueError("max_failures_per_minute must be >= 1")


class DeploymentConfig(DeploymentSpec):
    #: the fair queue in front of this deployment (defaults apply when omitted)
    queue: QueueSpec | None = None


class Config(SpecBase):
    #: the listening ports, connection limits, timeouts and drain
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    #: where keys, limits, quotas and usage are kept (shared by workers and replicas)
    state: StateConfig = msgspec.field(default_factory=StateConfig)
    #: the admin API and console's keys
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    #: OpenTelemetry traces (docs/tracing.md)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    #: tenant name -> fair-share weight, limits, quotas and the models it may see
    tenants: dict[str, TenantSpec] = msgspec.field(default_factory=dict)
    #: deployment name -> one running model on one backend
    deployments: dict[str, DeploymentConfig] = msgspec.field(default_factory=dict)
    #: model name (what clients ask for) -> the deployments that serve it (docs/routing.md)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)
    #: models made of other models: steps, tensor mapping, cascades (router/graphs.py)
    graphs: dict[str, GraphConfig] = msgspec.field(default_factory=dict)
    #: circuit breakers of every deployment (changeable by reload)
    breakers: BreakerConfig = msgspec.field(default_factory=BreakerConfig)
    #: OpenAI Batch API: files directory and how jobs run (gateway/batches)
    batches: BatchesConfig = msgspec.field(default_factory=BatchesConfig)


def with_listen_overrides(config: Config, listen: Mapping[str, Any]) -> Config:
    """`config` with `server.host` / `server.port` replaced by command-line values (`serve --host/--port`)."""
    if not listen:
        return config
    return msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, **listen))


# --- loading -----------------------------------------------------------------------------------

_ENV_PATTERN = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: route weights of one model must add up to this (percent)
WEIGHT_TOTAL = 100.0


def _interpolate(node: Any, path: str, env: dict[str, str]) -> Any:
    """Replace `${NAME}` in every string of the tree; a missing variable is an error."""
    if isinstance(node, str):

        def repl(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in env:
                raise ConfigError(f"environment variable {name} is not set - at `{path}`")
            return env[name]

        return _ENV_PATTERN.sub(repl, node)
    if isinstance(node, dict):
        return {k: _interpolate(v, f"{path}.{k}", env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, f"{path}[{i}]", env) for i, v in enumerate(node)]
    return node


def _resolve(path: str | None, base_dir: Path) -> str | None:
    if path is None or os.path.isabs(path):
        return path
    return str((base_dir / path).resolve())


def _resolve_paths(config: Config, base_dir: Path) -> Config:
    deployments = {}
    for name, dep in config.deployments.items():
        embedding = dep.embedding
        if embedding is not None:
            embedding = msgspec.structs.replace(embedding, tokenizer=_resolve(embedding.tokenizer, base_dir))
        adapters = {adapter: str(_resolve(path, base_dir)) for adapter, path in dep.adapters.items()}
        deployments[name] = msgspec.structs.replace(
            dep, model=_resolve(dep.model, base_dir), embedding=embedding, adapters=adapters
        )
    state = config.state
    if state.url.startswith("sqlite:///") and not state.url.startswith("sqlite:////"):
        relative = state.url.removeprefix("sqlite:///")
        state = msgspec.structs.replace(state, url="sqlite:///" + str(_resolve(relative, base_dir)))
    batches = msgspec.structs.replace(config.batches, files_dir=str(_resolve(config.batches.files_dir, base_dir)))
    return msgspec.structs.replace(config, deployments=deployments, state=state, batches=batches)


def _check_model(model: str, spec: ModelConfig, names: Mapping[str, object]) -> None:
    base = f"$.models.{model}"
    refs = [(f"{base}.routes[{i}].deployment", r.deployment) for i, r in enumerate(spec.routes)]
    refs += [(f"{base}.fallback[{i}]", d) for i, d in enumerate(spec.fallback)]
    refs += [(f"{base}.versions.{v}", d) for v, d in spec.versions.items()]
    if spec.shadow is not None:
        refs.append((f"{base}.shadow.deployment", spec.shadow.deployment))
    for path, name in refs:
        if name not in names:
            raise ConfigError(f"unknown deployment {name!r} - at `{path}`")
    # routes that only the shadow uses take no traffic of their own; the others must take it all
    served = [r for r in spec.routes if spec.shadow is None or r.deployment != spec.shadow.deployment]
    if sum(r.weight for r in served) <= 0:
        raise ConfigError(f"no route of the model has a positive weight - at `{base}.routes`")
    total = sum(r.weight for r in spec.routes)
    if len(spec.routes) > 1 and abs(total - WEIGHT_TOTAL) > 1e-6:
        raise ConfigError(f"route weights add up to {total:g}, not {WEIGHT_TOTAL:g} - at `{base}.routes`")
    canaries = spec.canaries()
    if canaries and all(r.deployment in canaries for r in spec.routes if r.weight > 0):
        raise ConfigError(f"a canary needs a baseline route (one that is not a canary) - at `{base}.routes`")
    for label, version in spec.labels.items():
        if version not in spec.versions:
            raise ConfigError(f"label points to unknown version {version!r} - at `{base}.labels.{label}`")


def _check_references(config: Config) -> None:
    """Cross-section checks msgspec cannot do: names, weights, devices, files."""
    config_checks.check_model_names(config)
    for model, spec in config.models.items():
        _check_model(model, spec, config.deployments)
    config_checks.check_fallback_kinds(config)
    # before the files: a config checked away from its models still gets these checked
    config_checks.check_devices(config)
    config_checks.check_providers(config)
    for name, dep in config.deployments.items():
        if dep.model is not None and not os.path.exists(dep.model):
            raise ConfigError(f"model file {dep.model} does not exist - at `$.deployments.{name}.model`")
    _check_adapters(config)
    _check_graphs(config)
    for name, dep in config.deployments.items():
        if "quantization" in dep.options and dep.backend != "torch_llm":
            raise ConfigError(
                f"{dep.backend} has no quantization option: serve an INT8 model file instead (for OpenVINO, "
                f"`fleetgate quantize` writes one) - at `$.deployments.{name}.options.quantization`"
            )


def _check_adapters(config: Config) -> None:
    """Adapter names are model names: unique, not also a `models:` entry, on a torch_llm base."""
    owner: dict[str, str] = {}
    for name, dep in config.deployments.items():
        for adapter, path in dep.adapters.items():
            where = f"$.deployments.{name}.adapters.{adapter}"
            if dep.backend != "torch_llm":
                raise ConfigError(f"LoRA adapters are served by torch_llm deployments only - at `{where}`")
            if adapter in config.models:
                raise ConfigError(
                    f"adapter {adapter!r} is also a model in `models:`; an adapter is a model of its own, "
                    f"pick another name - at `{where}`"
                )
            if adapter in owner:
                raise ConfigError(
                    f"adapter {adapter!r} is also declared by deployment {owner[adapter]!r} - at `{where}`"
                )
            if not os.path.isdir(path):
                raise ConfigError(f"adapter folder {path} does not exist - at `{where}`")
            owner[adapter] = name


def _check_graphs(config: Config) -> None:
    """Graph names are model names; each graph's structure, then its tensors where the model files
    tell their signatures (one line per problem, naming the path)."""
    adapters = {a for dep in config.deployments.values() for a in dep.adapters}
    signatures: dict[str, ModelMetadata | None] = {}

    def signature(model: str) -> ModelMetadata | None:
        if model not in signatures:
            routes = [r.deployment for r in config.models[model].routes]
            found = (read_signature(config.deployments[d]) for d in routes if d in config.deployments)
            signatures[model] = next((s for s in found if s is not None), None)
        return signatures[model]

    for name, graph in config.graphs.items():
        if name in config.models or name in adapters:
            raise ConfigError(
                f"graph {name!r} is also a model name; pick another name - at `$.graphs.{name}`"
            )
        try:
            check_graph(name, graph, config.models)
            check_graph_tensors(name, graph, signature)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for step_name, step in graph.steps.items():
            if _generates_text(config, step.model):
                raise ConfigError(
                    f"model {step.model!r} generates text; a graph step calls a tensor model "
                    f"- at `$.graphs.{name}.steps.{step_name}.model`"
                )


def _generates_text(config: Config, model: str) -> bool:
    """Whether every route of `model` is a text-generation deployment (an LLM, an OpenAI upstream)."""
    routes = [config.deployments.get(r.deployment) for r in config.models[model].routes]
    return all(
        d is not None and (d.backend == "torch_llm" or (d.backend == "remote" and d.protocol == "openai"))
        for d in routes
    )


def _rebase(message: str, prefix: str) -> str:
    """Point a msgspec error message, whose path starts at an entry, at the entry's place in the file."""
    if " - at `$" in message:
        return message.replace(" - at `$", f" - at `{prefix}", 1)
    return f"{message} - at `{prefix}`"


def _check_named_entries(raw: dict[str, Any]) -> None:
    """Decode each entry of the name -> entry sections alone, so an error names the entry.

    msgspec reports a path inside a dict value as `$.deployments[...]`; a user needs the name.
    """
    for section, kind in (
        ("tenants", TenantSpec),
        ("deployments", DeploymentConfig),
        ("models", ModelConfig),
        ("graphs", GraphConfig),
    ):
        entries = raw.get(section)
        if not isinstance(entries, dict):
            continue
        for name, entry in entries.items():
            try:
                msgspec.convert(entry, kind, strict=True)
            except msgspec.ValidationError as exc:
                raise ConfigError(_rebase(with_choices(str(exc), kind), f"$.{section}.{name}")) from None


def _default_grpc_port(raw: dict[str, Any], environ: Mapping[str, str]) -> None:
    """`server.grpc_port` from `FLEETGATE_GRPC_PORT` when the config does not set it."""
    value = environ.get("FLEETGATE_GRPC_PORT")
    server = raw.get("server")
    if value is None or (isinstance(server, dict) and "grpc_port" in server):
        return
    if server is None:
        server = raw["server"] = {}
    if not isinstance(server, dict):
        return  # refused by the decoder with its path
    if value.strip().lower() in ("off", "null", "none", ""):
        server["grpc_port"] = None
    elif value.strip().isdigit():
        server["grpc_port"] = int(value)
    else:
        raise ConfigError(f"FLEETGATE_GRPC_PORT must be a port number or `off`, got {value!r}")


def parse_config(
    text: str, *, base_dir: Path, env: dict[str, str] | None = None, source: str | None = None
) -> Config:
    """Decode and check a YAML config. Raises ConfigError with one line naming the path.

    `source` names the file in YAML syntax errors (`load_config` passes the path).
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise yaml_error(exc, text, source) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a mapping of sections - at `$`")
    environ = dict(os.environ) if env is None else env
    raw = _interpolate(raw, "$", environ)
    _default_grpc_port(raw, environ)
    _check_named_entries(raw)
    try:
        config = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(with_choices(str(exc), Config)) from None
    config = _resolve_paths(config, base_dir)
    _check_references(config)
    if config.server.workers > 1 and config.state.url.startswith("memory://"):
        raise ConfigError(
            "server.workers > 1 needs a shared state (sqlite:/// or redis://): with memory:// each "
            "worker would keep its own keys and limits - at `$.state.url`"
        )
    return config


def load_config(path: str | os.PathLike[str], env: dict[str, str] | None = None) -> Config:
    """Read, decode and check a config file."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
    return parse_config(text, base_dir=file.resolve().parent, env=env, source=str(file))
