"""deploy/: the Kubernetes manifests validate offline against the Kubernetes schemas, and agree with
the app itself: the ConfigMap's config is accepted, the probe paths answer on a running gateway, the
HPA's metric is one /metrics exports, the grace period covers the drain, ports line up, no secret is
stored, and the image installs the way `make install` does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from gateway.config import Config, parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS
from tests.servers import serve_app

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.32"


def _documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _gateway_container() -> dict[str, Any]:
    spec = _one("Deployment", "fleetgate")["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == "fleetgate"]
    return container


@pytest.fixture(scope="module")
def config_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The ConfigMap's config, with /models pointing at demo models written here."""
    from backends.demo_models.digits import write_all

    models = tmp_path_factory.mktemp("models")
    write_all(models, savedmodel=False, llama=True)
    text = _one("ConfigMap", "fleetgate-config")["data"]["fleetgate.yaml"]
    return text.replace("/models/", f"{models}/")


def _config(text: str) -> Config:
    return parse_config(text, base_dir=Path("."))


@pytest.fixture(scope="module")
def running(config_text: str) -> Iterator[str]:
    # the same config, with memory state instead of the cluster's Redis and no gRPC port
    raw = yaml.safe_load(config_text)
    raw["state"] = {"url": "memory://"}
    raw["server"]["grpc_port"] = None
    served = parse_config(yaml.safe_dump(raw), base_dir=Path("."))
    with serve_app(create_app(served)) as url:
        yield url


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_configmaps_config_passes_check_config(config_text: str) -> None:
    create_app(_config(config_text))  # what `fleetgate check-config` runs


def test_probe_paths_answer_on_a_running_gateway(running: str) -> None:
    container = _gateway_container()
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert httpx.get(f"{running}{path}").status_code == 200, probe


def test_the_hpa_metric_is_exported(running: str) -> None:
    metric = _one("HorizontalPodAutoscaler", "fleetgate")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    text = httpx.get(f"{running}/metrics", headers=ADMIN_HEADERS).text
    assert f"# TYPE {metric} gauge" in text


def test_ports_line_up_and_the_grace_period_covers_the_drain(config_text: str) -> None:
    server = _config(config_text).server
    container = _gateway_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": server.port, "grpc": server.grpc_port}
    service_ports = {p["name"]: p["targetPort"] for p in _one("Service", "fleetgate")["spec"]["ports"]}
    assert service_ports == {"http": "http", "grpc": "grpc"}
    pod = _one("Deployment", "fleetgate")["spec"]["template"]["spec"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop == server.drain_grace_s
    assert pod["terminationGracePeriodSeconds"] > pre_stop + server.drain_grace_s + server.shutdown_timeout_s


def test_no_secret_is_stored_in_the_repository() -> None:
    secret = _one("Secret", "fleetgate-secrets")
    assert set(secret["stringData"]) == {"FLEETGATE_ADMIN_KEY", "FLEETGATE_METRICS_KEY"}
    assert all(value == "" for value in secret["stringData"].values())


def test_the_image_installs_as_make_install_does() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "RUN make install " in dockerfile and "EXTRAS=all" in dockerfile
    # serving's extras only: the test tools are `make test`'s (tests/deploy/test_makefile.py)
    assert "\nEXTRAS ?= all\n" in (ROOT / "Makefile").read_text()
