"""structlog set-up: readable on a terminal, JSON lines otherwise (or with TKCC_LOG_JSON=1).

Every line names what it concerns with `candidate=` and `agent=` keys where it has them;
`bind(agent=..)` gives a logger that tags all its lines. Logs go to stderr, so stdout
stays free for results (the CLI's last JSON line, the MCP stdio transport).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


def configure(json_lines: bool | None = None, level: str | None = None) -> None:
    global _configured
    if json_lines is None:
        json_lines = os.environ.get("TKCC_LOG_JSON") == "1" or not sys.stderr.isatty()
    lvl = getattr(logging, (level or os.environ.get("TKCC_LOG_LEVEL", "INFO")).upper(), logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False)
    _configured = True


def get_logger(name: str, **tags):
    if not _configured:
        configure()
    return structlog.get_logger(name).bind(component=name, **tags)
