"""structlog set-up: one JSON line per event on stdout, level from the config."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import msgspec
import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


#: values msgspec cannot encode natively (paths, exceptions, enums of other types) become strings
_encoder = msgspec.json.Encoder(enc_hook=str)


def _encode_json(event: dict[str, Any], **_: Any) -> bytes:
    return _encoder.encode(event)


def configure_logging(level: str = "info", *, json: bool = True, stream: TextIO | None = None) -> None:
    """Route structlog (and the stdlib loggers of our dependencies) to JSON lines on `stream`.

    The server logs to stdout; CLI commands log to stderr so that stdout carries only their
    result (a new key's secret, a usage table).
    """
    numeric = _LEVELS.get(level, logging.INFO)
    target = stream or sys.stdout
    binary = getattr(target, "buffer", None)
    renderer: Any
    if json and binary is not None:
        # The access line is written once per request: msgspec renders it to bytes about twice as
        # fast as json.dumps, and bytes go to the stream's buffer without another encode.
        renderer = structlog.processors.JSONRenderer(serializer=_encode_json)
        factory: Any = structlog.BytesLoggerFactory(file=binary)
    else:
        renderer = (
            structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
        )
        factory = structlog.PrintLoggerFactory(file=target)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(
        level=max(numeric, logging.WARNING), stream=sys.stderr, format="%(name)s %(levelname)s %(message)s"
    )
