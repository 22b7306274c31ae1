"""The entry points' shared body: parse the command line, train a run of the algorithm the entry point names, and print
a fault as one line.

The exit status is 1 for a fault, 2 for settings, data files, a run directory in use and a model that does not
fit; 143 or 130 after SIGTERM or SIGINT, once the step under way is checkpointed, with the command that resumes.

    python -m algos.red_grpo --preset tiny --run-dir /tmp/red-tiny   # an entry point: algos.run.launch.main
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from agents.evaluation import EvaluationFailed
from algos import distributed
from algos.checkpoints.atomic import CheckpointWriteError
from algos.checkpoints.store import find_latest
from algos.config import Config
from algos.registry import algorithm
from algos.run import control as run_control
from algos.run.cli import parse_config
from algos.run.logs import set_up_logging
from algos.run.memory import DoesNotFit
from algos.run.training_run import TrainingRun, TrainingStopped
from algos.settings import AlgoName
from envs.data import DataError
from retrievers.corpus import CorpusError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, *, algo: AlgoName, description: str | None = None) -> dict[str, Any]:
    """Parse the command line, train, and return the summary (the entry points' shared body).

    A fault ends the process with one line: exit status 2 for settings, data files and a run directory that cannot
    be used (holding another run's checkpoints, or locked by a run in progress: `run_control.lock_run_dir`), 1 for
    the rest (a full or read-only disk among them, with the checkpoint to resume from; a held-out evaluation whose
    sampler or retriever failed on more than 5% of its episodes). SIGTERM or Ctrl-C stops
    after the step under way with a checkpoint of it and one line that says how to resume; the exit status is then
    143 or 130 (`run_control.StopSignals`).

    Args:
        argv: Arguments without the program name; None reads sys.argv.
        algo: A registered algorithm's name (`algos.registry`): its learner trains, its settings class parses the
            command line, its defaults apply over the preset's (flags still override them). The registry names the
            learner, so this module, which the learners build on, never imports one.
        description: The entry point's ``--help`` text.
    """
    config = parse_config(argv, algo=algo, description=description)
    algorithm(algo).learner_class()  # a learner that cannot be imported fails here, before any setup
    set_up_logging(verbose=config.run.verbose)  # third-party INFO chatter and progress bars off unless --verbose
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            with run_control.StopSignals(at_once=True):  # SIGTERM or Ctrl-C in setup ends it: nothing trained yet
                run = TrainingRun(config)
        except (DataError, CorpusError, FileExistsError, FileNotFoundError, DoesNotFit, run_control.RunDirInUse) as err:
            _exit_with(err, 2)  # a user's data or corpus, run dir (holding checkpoints, or in use) or model size
        except ImportError as err:  # an optional dependency that cannot serve (a vLLM without in-place weight updates)
            _exit_with(err, 2)
        except (TrainingStopped, ConnectionError, CheckpointWriteError) as err:  # nothing to resume, no server, disk
            _exit_with(err, 1)
        except RuntimeError as err:
            _exit_if_timed_out(err, config)
            raise
        except run_control.Interrupted as err:
            command = run_control.rerun_command(args, config.run.output_dir, resume=config.run.resume)
            _stop_with(err, command, show=True)
        try:
            return run.train()
        except (TrainingStopped, EvaluationFailed) as err:  # EvaluationFailed: the held-out scoring's server failed
            _exit_with(err, 1)
        except CheckpointWriteError as err:  # a full or read-only disk: the checkpoints written before it are intact
            latest = find_latest(run.checkpoint_dir)
            command = run_control.rerun_command(args, config.run.output_dir, resume=latest is not None)
            where = f"the last good checkpoint is {latest}" if latest is not None else "no checkpoint was written yet"
            _exit_with(OSError(f"{err}; {where}: once there is room (or it is writable again), run {command}"), 1)
        except RuntimeError as err:
            _exit_if_timed_out(err, config)
            raise
        except run_control.Interrupted as err:  # a checkpoint of the last finished step is on disk
            command = run_control.rerun_command(args, config.run.output_dir, resume=True)
            _stop_with(err, command, show=run.world.is_main)
        finally:
            run.close()
    finally:
        run_control.release_run_dir(
            config.run.output_dir
        )  # for a caller that goes on (the process's end releases it too)


def _exit_with(err: BaseException, status: int) -> NoReturn:
    """Print a fault as one line (no traceback: the message says what to do) and exit with `status`."""
    print(f"error: {err}", file=sys.stderr)
    raise SystemExit(status) from None


def _exit_if_timed_out(err: RuntimeError, config: Config) -> None:
    """Exit with one line (status 1) when `err` is a collective that waited past ``--dist-timeout-seconds``.

    gloo raises its timeout as a plain RuntimeError ("Timed out waiting ...ms"), NCCL as a DistBackendError; either
    means another rank stopped, hung or died, which its own output explains, so a traceback here says nothing more.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if not (isinstance(err, dist.DistError) or "timed out" in str(err).lower()):
        return
    detail = (str(err).strip().splitlines() or [""])[0][:200]
    distributed.shutdown()
    _exit_with(
        TimeoutError(
            f"a collective operation waited more than --dist-timeout-seconds {config.run.dist_timeout_seconds:g} "
            f"for the other ranks (one stopped, hung or died: see its output), so this rank stopped too ({detail})"
        ),
        1,
    )


def _stop_with(err: run_control.Interrupted, command: str, show: bool) -> NoReturn:
    """Print how to go on after a stop by a signal as one line (when `show`) and exit with 128 + its number."""
    if show:
        print(err.message(command), file=sys.stderr)
    raise SystemExit(err.exit_status) from None
