"""Structured logging with structlog: JSON lines in containers, readable lines on a terminal.

Secrets never reach a log line: values of keys that look like credentials
(``*password*``, ``*secret*``, ``*.key``, ``sasl.*``, ``ssl.key*``) are replaced by ``***``.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

SECRET_KEY = re.compile(r"(password|secret|token|sasl\.|ssl\.key|\.key$|credential)", re.I)


def redact(settings: dict[str, Any]) -> dict[str, Any]:
    """Return ``settings`` with credential-like values replaced by ``***``."""
    return {k: ("***" if SECRET_KEY.search(k) else v) for k, v in settings.items()}


def _redact_event(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
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
    renderer: Processor = (
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


class _RateLimited(logging.Filter):
    """Let each distinct librdkafka message through once per ``every_s`` seconds.

    A broker that refuses connections makes librdkafka log the same line every reconnect
    backoff (hundreds of lines a minute); the first one says everything. The transient
    "Coordinator load in progress" retry of a fresh broker is not worth a line at all.
    """

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self.every_s = every_s
        self._last_s: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Coordinator load in progress" in message:
            return False
        key = re.sub(r"\d+", "#", message.split("]: ", 1)[-1])
        now_s = time.monotonic()
        last_s = self._last_s.get(key)
        if last_s is not None and now_s - last_s < self.every_s:
            return False
        self._last_s[key] = now_s
        return True


def kafka_logger() -> logging.Logger:
    """The logger every Kafka client of streamproc passes as librdkafka's ``logger``:
    warnings and errors to stderr, each distinct message at most once a minute."""
    logger = logging.getLogger("streamproc.librdkafka")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("librdkafka %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.addFilter(_RateLimited())
        logger.setLevel(logging.WARNING)
        logger.propagate = False
    return logger


def get_logger(name: str) -> FilteringBoundLogger:
    """A structlog logger bound to ``component=name`` (structlog's default wrapper class, and the
    one :func:`configure` sets, is the filtering bound logger)."""
    logger: FilteringBoundLogger = structlog.get_logger(component=name)
    return logger
