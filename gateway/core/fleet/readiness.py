"""Whether the fleet this process serves is ready for traffic, and each deployment's state, as the
probes (HTTP, gRPC, the health port) and the admin readiness detail report them."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.core.fleet.deployments import Deployment


def fleet_ready(readiness: str, draining: bool, deployments: Mapping[str, Deployment]) -> bool:
    """`server.readiness` over the deployments: `any` needs one loaded and warmed up (a gateway with
    no deployments, an admin-only front, is ready), `all` needs every one; a draining process is not."""
    if draining:
        return False
    states = [d.ready for d in deployments.values()]
    if readiness == "all" or not states:
        return all(states)
    return any(states)


def deployment_states(deployments: Mapping[str, Deployment]) -> dict[str, dict[str, object]]:
    """Per deployment: ready, backend, device and its load error (operators only: names tenants' models)."""
    return {
        name: {"ready": d.ready, "backend": d.spec.backend, "device": d.device, "error": d.load_error}
        for name, d in deployments.items()
    }
