"""structlog configuration shared by every actor and process of the engine.

Output goes to stderr: a coloured console renderer when stderr is a terminal, one JSON object
per line otherwise (or as forced by ``KVACTOR_LOG_FORMAT=console|json``). The level comes from
``KVACTOR_LOG_LEVEL`` (debug, info, warning, error; default info). Every line carries the
process id, so lines of a multi-process engine can be told apart.

Configuration happens once per process, lazily, on the first ``get_logger``; child processes
configure themselves the same way from the inherited environment.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Final

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, WrappedLogger

LOG_LEVEL_ENV: Final = "KVACTOR_LOG_LEVEL"
LOG_FORMAT_ENV: Final = "KVACTOR_LOG_FORMAT"

_configured = False
_debug_enabled = False


class _StderrLogger:
    """Writes each rendered line to the *current* ``sys.stderr`` (test runners swap it)."""

    def msg(self, message: str) -> None:
        stream = sys.stderr
        stream.write(message + "\n")
        stream.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _stderr_logger_factory(*_args: Any) -> _StderrLogger:
    return _StderrLogger()


def _add_pid(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    event.setdefault("pid", os.getpid())
    return event


def _level_number(level: str) -> int:
    number = logging.getLevelName(level.strip().upper())
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r} (use debug, info, warning or error)")
    return number


def configure_logging(
    level: str | None = None, *, json: bool | None = None, force: bool = False
) -> None:
    """Configure structlog for this process. Later calls are no-ops unless ``force``."""
    global _configured, _debug_enabled
    if _configured and not force:
        return
    level_number = _level_number(level or os.environ.get(LOG_LEVEL_ENV) or "info")
    if json is None:
        forced_format = os.environ.get(LOG_FORMAT_ENV, "").strip().lower()
        json = forced_format == "json" or (forced_format != "console" and not sys.stderr.isatty())
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_pid,
        structlog.processors.StackInfoRenderer(),
    ]
    if json:
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level_number),
        logger_factory=_stderr_logger_factory,
        cache_logger_on_first_use=False,
    )
    _configured = True
    _debug_enabled = level_number <= logging.DEBUG


def get_logger(name: str, **context: Any) -> FilteringBoundLogger:
    """A logger whose lines carry ``logger=name`` and any extra ``context`` key/values."""
    configure_logging()
    logger: FilteringBoundLogger = structlog.get_logger().bind(logger=name, **context)
    return logger


def debug_enabled() -> bool:
    """Whether debug lines are emitted; hot paths check this before building log events."""
    configure_logging()
    return _debug_enabled
