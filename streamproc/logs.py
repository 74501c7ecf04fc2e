"""Structured logging with structlog: JSON lines in containers, readable lines on a terminal.

Secrets never reach a log line: values of keys that look like credentials
(``*password*``, ``*secret*``, ``*.key``, ``sasl.*``, ``ssl.key*``) are replaced by ``***``.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

SECRET_KEY = re.compile(r"(password|secret|token|sasl\.|ssl\.key|\.key$|credential)", re.I)


def redact(settings: dict[str, Any]) -> dict[str, Any]:
    """Return ``settings`` with credential-like values replaced by ``***``."""
    return {k: ("***" if SECRET_KEY.search(k) else v) for k, v in settings.items()}


def _redact_event(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in list(event.items()):
        if isinstance(value, dict):
            event[key] = redact(value)
        elif SECRET_KEY.search(key):
            event[key] = "***"
    return event


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    """Configure structlog for the process: JSON lines or console lines to ``stream``
    (default stderr)."""
    stream = stream or sys.stderr
    json_lines = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact_event,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,  # configure() may come after first use
    )


def get_logger(name: str) -> Any:
    """A structlog logger bound to ``component=name``."""
    return structlog.get_logger(component=name)
