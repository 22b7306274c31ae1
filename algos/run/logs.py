"""Logging set-up shared by the entry points."""

from __future__ import annotations

import logging

QUIET_LOGGERS = ("httpx", "httpcore")
"""HTTP client libraries that log every request at INFO ("HTTP Request: POST .../retrieve 200 OK"): under a root
logger at INFO they would write one line per search or remote generation into a run's log."""


def quiet_http_logs(level: int = logging.WARNING) -> None:
    """Raise the HTTP client loggers (`QUIET_LOGGERS`) to `level`, so only their warnings and errors reach the log."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(level)
