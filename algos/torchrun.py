"""torchrun for the trainers, stopping as they do: ``python -m algos.torchrun`` takes torchrun's own flags.

    python -m algos.torchrun --standalone --nproc-per-node 2 -m algos.grpo_sft --preset cpu

A trainer under torchrun stops on SIGTERM or Ctrl-C after the step under way: every rank agrees on the step, rank 0
writes its checkpoint and prints one line with the command that resumes it, and each worker exits 143 or 130. The
launcher itself, though, turns the signal into an exception in its own process: torchrun forwards the signal, waits
for the workers, then prints a 28-line traceback (``SignalException``) and exits 1. It also kills the workers 30 s
after the signal (its ``--shutdown-timeout``), which a step on a CPU can outlast, so that the checkpoint is lost.

This module is torchrun (torch's own parser and elastic agent: every flag means the same) with two differences:

- a stop by a signal ends with the workers' one line and the signal's status (143, 130), without a traceback;
- the workers get 600 s to finish their step (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, unless the environment or
  ``--shutdown-timeout`` sets it).

With plain torchrun the workers behave the same; ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600 torchrun ...`` gives them the
same time, and the traceback and exit status 1 after the resume line are torchrun's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["LAUNCHER", "SHUTDOWN_TIMEOUT_S", "main"]

LAUNCHER = "python -m algos.torchrun"
"""How the workers' resume line names this launcher (`algos.run.control.rerun_command` reads it from
``REDCODA_LAUNCHER``)."""

SHUTDOWN_TIMEOUT_S = 600
"""Seconds the workers get, after the signal, to finish the step under way and write its checkpoint."""


def main(argv: Sequence[str] | None = None) -> None:
    """Launch the workers as torchrun does; exit with their status, or 128 + the signal that stopped them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    os.environ["REDCODA_LAUNCHER"] = LAUNCHER  # the workers inherit it
    try:
        run(args)
    except SignalException as err:  # the workers stopped on the forwarded signal and said how to resume
        raise SystemExit(128 + int(err.sigval)) from None
    except ChildFailedError as err:  # a worker failed: its own output has the cause; one line here
        failures = err.failures
        first = failures[min(failures)] if failures else None
        detail = f"rank {first.local_rank} exited with {first.exitcode}" if first is not None else "a worker failed"
        print(f"error: {detail} (its output above says why)", file=sys.stderr)
        raise SystemExit(first.exitcode if first is not None and first.exitcode > 0 else 1) from None


if __name__ == "__main__":
    main()
