"""structlog set-up: JSON lines (or console) on stderr, level and format from the policy."""

from __future__ import annotations

import logging
import sys

import orjson
import structlog

from policies.schema import Logging

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_level: int | None = None  # the configured level; None: structlog's defaults (everything is written)


def emits(level: int) -> bool:
    """Whether an event at ``level`` is written: a caller that would build a large event skips it."""
    return _level is None or level >= _level


def configure(cfg: Logging) -> None:
    global _level
    _level = _LEVELS[cfg.level]
    renderer: structlog.typing.Processor
    if cfg.format == "json":
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
        factory: structlog.typing.WrappedLogger = structlog.BytesLoggerFactory(sys.stderr.buffer)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[cfg.level]),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
