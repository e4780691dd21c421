"""The inference routes answered ahead of Litestar's router (gateway/hot_routes.py), over real HTTP.

A forwarding counter in front of Litestar's own handler shows which requests reached the router:
the hot routes must answer everything they match themselves, in their protocol's envelope (errors
included), and pass everything else on unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from backends.demo_models.digits import digits_split
from gateway import hot_routes
from gateway.app import create_app
from gateway.config import parse_config
from gateway.hot_routes import HotRoutes
from tests.conftest import create_key, gateway_yaml
from tests.servers import serve_app


@dataclass
class Served:
    url: str
    headers: dict[str, str]
    routed: list[str]  # paths Litestar's router saw


@pytest.fixture(scope="module")
def served(digits, upstream_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:  # noqa: ANN001
    state = tmp_path_factory.mktemp("hot-state") / "fleetgate.db"
    app = create_app(
        parse_config(gateway_yaml(digits, upstream_url, f"sqlite:///{state}"), base_dir=Path("."))
    )
    hot = app.asgi_handler
    assert isinstance(hot, HotRoutes)
    routed: list[str] = []
    router = hot._inner

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        routed.append(scope["path"])
        await router(scope, receive, send)

    hot._inner = counting
    with serve_app(app) as url:
        headers = {"Authorization": f"Bearer {create_key(url, 'acme')}"}
        routed.clear()
        yield Served(url, headers, routed)


def _v2_body(rows: np.ndarray) -> dict[str, Any]:
    return {
        "inputs": [
            {"name": "input", "shape": list(rows.shape), "datatype": "FP32", "data": rows.ravel().tolist()}
        ]
    }


def test_infer_and_generation_routes_are_answered_without_the_router(served: Served) -> None:
    rows = digits_split()[1][:2]
    for path in ("/v2/models/digits/infer", "/v2/models/digits/versions/2/infer"):
        r = httpx.post(served.url + path, json=_v2_body(rows), headers=served.headers)
        assert r.status_code == 200, r.text
        assert {o["name"] for o in r.json()["outputs"]} == {"probabilities", "label"}
    chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(served.url + "/v1/chat/completions", json=chat, headers=served.headers)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    completion = {"model": "echo", "prompt": "hi", "max_tokens": 4}
    r = httpx.post(served.url + "/v1/completions", json=completion, headers=served.headers)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"
    for path in (
        "/v1/models/digits:predict",
        "/v1/models/digits/versions/2:predict",
        "/v1/models/digits/labels/stable:predict",
    ):
        r = httpx.post(served.url + path, json={"instances": rows.tolist()}, headers=served.headers)
        assert r.status_code == 200, (path, r.text)
        assert len(r.json()["predictions"]) == 2
    assert served.routed == []


def test_errors_on_hot_routes_keep_each_protocols_envelope(served: Served) -> None:
    rows = digits_split()[1][:1]
    r = httpx.post(served.url + "/v2/models/no%20such/infer", json=_v2_body(rows), headers=served.headers)
    assert r.status_code == 404 and "error" in r.json() and "x-request-id" in r.headers
    r = httpx.post(
        served.url + "/v2/models/digits/infer", json=_v2_body(rows), headers={"Authorization": "Bearer nope"}
    )
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    r = httpx.post(served.url + "/v1/chat/completions", content=b"{not json", headers=served.headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        served.url + "/v1/models/digits:classify", json={"instances": rows.tolist()}, headers=served.headers
    )
    assert r.status_code == 400 and "predict" in r.json()["error"]  # TF Serving's envelope: a string
    assert served.routed == []


def test_other_requests_still_go_through_the_router(served: Served) -> None:
    served.routed.clear()
    r = httpx.get(served.url + "/v2/models/digits/infer", headers=served.headers)  # wrong method
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(served.url + "/v2/models/digits", headers=served.headers)  # metadata: not hot
    assert r.status_code == 200 and r.json()["name"] == "digits"
    r = httpx.post(served.url + "/v2/models/a/b/infer", json={}, headers=served.headers)  # no such route
    assert r.status_code == 404
    assert served.routed == ["/v2/models/digits/infer", "/v2/models/digits", "/v2/models/a/b/infer"]


def test_a_stream_is_served_on_the_fast_path(served: Served) -> None:
    served.routed.clear()
    chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=chat, headers=served.headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2
    assert served.routed == []


def test_a_malformed_host_header_is_left_to_the_router(served: Served) -> None:
    served.routed.clear()
    rows = digits_split()[1][:1]
    headers = {**served.headers, "Host": "bad host!"}
    r = httpx.post(served.url + "/v2/models/digits/infer", json=_v2_body(rows), headers=headers)
    assert r.status_code == 400  # Litestar's router refuses it, as without the fast path
    assert served.routed == ["/v2/models/digits/infer"]


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("on", True), ("off", False), (" OFF ", False), ("0", False)]
)
def test_the_switch(value: str | None, on: bool) -> None:
    assert hot_routes.enabled(value) is on


def test_switched_off_every_route_goes_to_litestar(
    digits, upstream_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    monkeypatch.setenv(hot_routes.SWITCH_ENV, "off")
    app = create_app(parse_config(gateway_yaml(digits, upstream_url, "memory://"), base_dir=Path(".")))
    assert not isinstance(app.asgi_handler, HotRoutes)
    # the handlers' bare ASGI answers (RawResponse) are served by Litestar's routes alike
    with serve_app(app) as url:
        headers = {"Authorization": f"Bearer {create_key(url, 'acme')}"}
        chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(url + "/v1/chat/completions", json=chat, headers=headers)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
        assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"]
        rows = digits_split()[1][:2].astype(np.float32)
        r = httpx.post(url + "/v2/models/digits/infer", json=_v2_body(rows), headers=headers)
        assert r.status_code == 200 and r.json()["outputs"], r.text


def test_it_refuses_to_bypass_middleware() -> None:
    from litestar import Litestar
    from litestar.middleware import DefineMiddleware

    async def passthrough(scope: Any, receive: Any, send: Any) -> None:  # never called
        raise AssertionError

    app = Litestar([], middleware=[DefineMiddleware(lambda app: passthrough)])
    with pytest.raises(RuntimeError, match="middleware"):
        hot_routes.install(app)
