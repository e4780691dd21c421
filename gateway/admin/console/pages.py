"""Rendering for the console: pages with their security headers, forms, and the answers to failures.

Every console answer (pages, errors, the traffic JSON, static files) carries the same headers: a
Content-Security-Policy that allows scripts, styles and fetches from this origin only (so no inline
script runs, even one that slipped into a page), no framing, no caching, no content sniffing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import structlog
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Template
from litestar.template import TemplateConfig

from backends.errors import InvalidInput
from fleetgate.errors import describe
from gateway.admin.console.session import NotSignedIn
from gateway.http.requests import read_body

log = structlog.get_logger(__name__)

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"
BASE = "/admin/ui"

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    # same-origin, not no-referrer: with no-referrer a browser sends `Origin: null` on form posts
    "referrer-policy": "same-origin",
    # pages show key secrets (once) and tenants' usage: never kept by a browser or a proxy
    "cache-control": "no-store",
}
#: a console form is a few short fields
_FORM_LIMIT = 16 * 1024


def _environment() -> Environment:
    # autoescape on every template: a tenant or key named `<script>` is shown as text
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = _num
    return env


def _num(value: float | None, digits: int = 1) -> str:
    """A figure for a table cell: `–` when unknown, no trailing `.0` on whole numbers."""
    if value is None or value != value:  # None or NaN
        return "–"
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.{digits}f}"


TEMPLATES = TemplateConfig(engine=JinjaTemplateEngine.from_environment(_environment()))


def page(name: str, status: int = 200, **context: Any) -> Template:
    """A console page from `templates/<name>.html`, with the security headers."""
    context.setdefault("csrf", "")
    context.setdefault("signed_in", bool(context["csrf"]))
    context.setdefault("base", BASE)
    return Template(
        template_name=f"{name}.html", context=context, status_code=status, headers=dict(SECURITY_HEADERS)
    )


def secure(response: Response[Any]) -> Response[Any]:
    """Add the security headers to a response built elsewhere (static files, JSON, redirects)."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def redirect(path: str) -> Response[bytes]:
    """303 See Other to a console page: after a successful post, the browser loads it with GET."""
    return secure(Response(content=b"", status_code=303, headers={"location": f"{BASE}{path}"}))


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (the last value of a repeated field); 400/413/415 on bad input."""
    raw = await read_body(request, _FORM_LIMIT, allowed_types=("application/x-www-form-urlencoded",))
    try:
        fields = parse_qs(
            raw.decode("utf-8"), keep_blank_values=True, max_num_fields=32, strict_parsing=False
        )
    except (UnicodeDecodeError, ValueError):
        raise InvalidInput("the form is not valid urlencoded UTF-8") from None
    return {name: values[-1] for name, values in fields.items()}


def not_signed_in(_request: Request, _exc: NotSignedIn) -> Template:
    """Any console route without a valid session: the sign-in form, 401 (a tenant key is no session)."""
    return page("login", status=401, error=None)


def failed(request: Request, exc: Exception) -> Template:
    """A refused action or page (bad form, unknown key, admin API off, too many attempts) as a page
    with its status and message; anything unexpected is a 500 whose detail goes to the log only."""
    known = describe(exc)
    if isinstance(exc, HTTPException):  # the framework's own: no such page, wrong method
        status, message, headers = exc.status_code, str(exc.detail), {}
    elif known is None:
        log.exception("console_error", path=request.url.path, exc_info=exc)
        status, message, headers = 500, "internal error; see the gateway log", {}
    else:
        status, _, message, headers = known
    template = page("error", status=status, status_code=status, message=message)
    template.headers.update(headers)
    return template
