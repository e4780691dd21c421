"""`GET /` points to the docs, and `/docs` works on a box that reaches no CDN: every asset the page
loads is a path on the gateway itself, and the gateway answers it."""

from __future__ import annotations

from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.servers import serve_app


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = parse_config('state: {url: "memory://"}\n', base_dir=Path("."), env={})
    with serve_app(create_app(config)) as base:
        yield base


class _Assets(HTMLParser):
    """Every address a page makes the browser fetch on load: script src, link href, img src."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = {"script": "src", "link": "href", "img": "src", "iframe": "src"}.get(tag)
        for name, value in attrs:
            if name == wanted and value:
                self.urls.append(value)


def test_docs_assets_are_served_by_the_gateway(url: str) -> None:
    page = httpx.get(f"{url}/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    parser = _Assets()
    parser.feed(page.text)
    assert any(u.endswith(".js") for u in parser.urls) and any(u.endswith(".css") for u in parser.urls)
    for asset in parser.urls:
        absolute = urljoin(f"{url}/docs", asset)
        assert urlsplit(absolute).netloc == urlsplit(url).netloc, f"{asset} is fetched from another host"
        answer = httpx.get(absolute)
        assert answer.status_code == 200 and len(answer.content) > 1000, asset
    # the page reads the document it was served beside
    assert httpx.get(f"{url}/openapi.json").json()["openapi"].startswith("3.")


def test_root_points_to_the_docs_and_the_console(url: str) -> None:
    plain = httpx.get(url)
    assert plain.status_code == 200
    assert plain.json() | {"version": None} == {
        "name": "fleetgate",
        "version": None,
        "docs": "/docs",
        "openapi": "/openapi.json",
        "admin_openapi": "/admin/openapi.json",
        "console": "/admin/ui",
        "health": "/health/ready",
        "metrics": "/metrics",
    }
    browser = httpx.get(url, headers={"accept": "text/html,application/xhtml+xml"})
    assert browser.status_code == 200 and browser.headers["content-type"].startswith("text/html")
    assert 'href="/docs"' in browser.text and 'href="/admin/ui"' in browser.text
    assert "/" not in httpx.get(f"{url}/openapi.json").json()["paths"]  # not an API route
