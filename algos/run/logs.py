"""Logging set-up shared by the entry points: the run's own INFO lines, third-party chatter at WARNING.

A run's log is read by a person after the fact (a terminal, or a file of a job on a machine without one): it holds the
run's own lines (the preset, the memory and disk checks, the sampler's decode path, steps, checkpoints) and the
warnings and errors of everything else. Libraries that log routine work at INFO (`QUIET_LOGGERS`) are raised to
WARNING, and in a non-interactive run the weight-loading progress bars of transformers and huggingface_hub are off
(each redraw is a line in a file); ``--verbose`` keeps all of it.
"""

from __future__ import annotations

import logging
import sys

QUIET_LOGGERS = ("httpx", "httpcore", "bm25s", "faiss.loader", "urllib3", "filelock", "jax._src.xla_bridge")
"""Third-party loggers that write routine work at INFO: the HTTP clients one line per search or remote generation
("HTTP Request: POST .../retrieve 200 OK"), bm25s one per index it builds ("Building index from tokens"), faiss its
CPU probing, JAX its backend search."""


def quiet_http_logs(level: int = logging.WARNING) -> None:
    """Raise the third-party loggers (`QUIET_LOGGERS`) to `level`, so only their warnings and errors reach the log."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(level)


class BelowWarning(logging.Filter):
    """Drops the INFO and DEBUG records of `QUIET_LOGGERS` (and their children) at a handler: a library may set its
    own logger's level when it is imported (bm25s sets DEBUG), after `quiet_http_logs` ran."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return not any(record.name == name or record.name.startswith(name + ".") for name in QUIET_LOGGERS)


def set_up_logging(*, verbose: bool = False, interactive: bool | None = None) -> None:
    """The entry points' logging: INFO lines with time and logger name; third-party loggers at WARNING and, in a
    non-interactive run, no weight-loading progress bars, unless `verbose`.

    Args:
        verbose: keep third-party INFO lines and progress bars (``--verbose``).
        interactive: whether a person watches the output; None: whether stderr is a terminal.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if verbose:
        return
    quiet_http_logs()
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, BelowWarning) for f in handler.filters):
            handler.addFilter(BelowWarning())
    if interactive is None:
        interactive = sys.stderr.isatty()
    if not interactive:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        disable_progress_bars()
