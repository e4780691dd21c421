"""deploy/: the pull-models init container runs `fleetgate pull` on the gateway's own config, into
the volume that config's `storage.cache_dir` names, and the gateway mounts that volume too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gateway.serve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _deployment() -> dict[str, Any]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    (doc,) = [d for d in docs if d and d["kind"] == "Deployment"]
    return doc["spec"]["template"]["spec"]


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container["volumeMounts"]}


def test_the_init_container_pulls_the_gateways_config_into_its_cache() -> None:
    pod = _deployment()
    (pull,) = [c for c in pod["initContainers"] if c["name"] == "pull-models"]
    (gateway,) = [c for c in pod["containers"] if c["name"] == "fleetgate"]
    args = build_parser().parse_args(pull["args"])  # a command line the CLI accepts
    assert args.command == "pull" and args.config == gateway["args"][gateway["args"].index("--config") + 1]
    configmap = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "configmap.yaml").read_text())
    cache_dir = yaml.safe_load(configmap["data"]["fleetgate.yaml"])["storage"]["cache_dir"]
    assert _mounts(pull)["model-cache"] == cache_dir == _mounts(gateway)["model-cache"]
    assert _mounts(pull)["config"] == _mounts(gateway)["config"]
    assert "model-cache" in {v["name"] for v in pod["volumes"]}
    # the credentials' Secret is optional and never stored in the repository
    assert {"secretRef": {"name": "fleetgate-model-credentials", "optional": True}} in pull["envFrom"]
    assert "fleetgate-model-credentials" not in (ROOT / "deploy" / "kubernetes" / "secret.yaml").read_text()
