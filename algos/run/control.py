"""What keeps a training process in order on a shared machine: its run directory locked, SIGTERM and Ctrl-C turned
into a clean stop, and a torch thread count that follows the load of the machine.

- `lock_run_dir`: an OS file lock (`filelock.FileLock`, a ``flock``) on ``<run_dir>/.lock``, taken before anything
  in the directory is read or written and held to the end of the process; ``.lock.holder`` names the holder (PID,
  host, start time), so a second run or ``--resume`` on the directory is refused with a message naming it
  (`RunDirInUse`). The kernel drops the lock when the holding process ends however it ends, so a lock file left by
  a dead process is simply locked again. The lock is the process's: opening the same directory again in one process
  (a test, a notebook resuming what it just ran) shares it.
- `StopSignals`: SIGTERM and SIGINT set a flag that the training loop reads between steps (the step under way
  finishes, a checkpoint of it is written, and the run ends with `Interrupted`: exit status 128 + the signal's
  number, 143 or 130, as a shell reports a process the signal ended); a second signal of either kind ends the
  process at once. During setup (``at_once``) the first signal already ends it: nothing has been trained yet. The
  JVM of the BM25 retriever starts with ``-Xrs`` (`retrievers.jvm.start_jvm`), so it leaves both signals to Python.
- `TorchThreads`: torch's CPU thread count, chosen from what other processes keep the cores busy with, re-checked
  between steps (`choose_threads` is the rule).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import filelock

logger = logging.getLogger(__name__)

__all__ = [
    "CpuReading",
    "Interrupted",
    "RunDirInUse",
    "RunDirLock",
    "StopSignals",
    "TorchThreads",
    "choose_threads",
    "lock_run_dir",
    "others_busy",
    "read_cpu",
    "release_run_dir",
    "rerun_command",
]

LOCK_FILE = ".lock"
"""The lock file's name inside a run directory."""
HOLDER_FILE = ".lock.holder"
"""The file beside it that names the lock's holder (PID, host, start time)."""


# --- the run directory's lock ------------------------------------------------------------------------------------
class RunDirInUse(RuntimeError):
    """Another process holds the run directory's lock; the message names it and says what to do."""


class RunDirLock:
    """An exclusive `filelock.FileLock` (an OS ``flock``) on ``<run_dir>/.lock``, held until `release` or the end of
    the process; the holder's record (PID, host, start time) is in ``<run_dir>/.lock.holder``.

    Args:
        run_dir: The run directory (created when missing).

    Raises:
        RunDirInUse: another process holds the lock.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.holder_path = self.run_dir / HOLDER_FILE
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # not thread-local: the lock is the process's, released from whichever thread ends the run (or the GC)
        self._lock: filelock.BaseFileLock | None = filelock.FileLock(self.path, timeout=0, thread_local=False)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            self._lock = None
            raise RunDirInUse(
                f"{self.run_dir} is in use by {_read_holder(self.holder_path)}: wait for that run to end or stop it "
                "(SIGTERM or Ctrl-C: it saves a checkpoint and exits), or choose another --run-dir"
            ) from None
        except BaseException:
            self.release()
            raise
        self._identity = _file_identity(self.path)  # the lock file this run holds: `lost` compares with it
        record = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        if _read_holder(self.holder_path, raw=True).split(",")[0] != record.split(",")[0]:  # a new holder: say so
            tmp = self.holder_path.with_name(f"{HOLDER_FILE}.{os.getpid()}")
            tmp.write_text(record, encoding="utf-8")
            os.replace(tmp, self.holder_path)  # whole: a refused process never reads half a record

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._lock is not None

    def lost(self) -> str | None:
        """Why this lock no longer guards its directory, or None while it does.

        A lock is on a file: when the directory is removed (or replaced by another run's, with a lock file of its
        own) the lock still holds, but on a file no other run can see, so a run that went on writing would write into
        a directory that is not its own. The run checks this before it writes (`algos.run.training_run.TrainingRun`).
        """
        try:
            now = _file_identity(self.path)
        except FileNotFoundError:
            now = None
        if now == self._identity:
            return None
        how = "removed" if now is None else "replaced (its lock file is not the one this run locked)"
        return f"{self.run_dir} was {how} while this run held it"

    def release(self) -> None:
        """Drop the lock (the lock file stays: deleting it would let two processes lock two different files)."""
        if self._lock is not None:
            lock, self._lock = self._lock, None
            _HELD.pop(str(self.run_dir.resolve()), None)
            lock.release(force=True)

    def __del__(self) -> None:
        try:  # at interpreter exit the modules it uses may be gone (no contextlib either); the OS releases the lock
            self.release()
        except Exception:
            pass


def _file_identity(path: Path) -> tuple[int, int]:
    """(device, inode): the same while the file is the same file, whatever its name."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


_HELD: weakref.WeakValueDictionary[str, RunDirLock] = weakref.WeakValueDictionary()
"""The run directories this process holds, by resolved path (a second open of one shares its lock)."""


def lock_run_dir(run_dir: str | os.PathLike, *, resume: bool = False) -> RunDirLock | None:
    """Lock `run_dir` for this process, or share the lock this process already holds on it.

    Args:
        run_dir: The run directory.
        resume: Whether the run resumes: a directory that does not exist then stays uncreated (there is nothing to
            resume in it, and the run says so without leaving an empty directory behind).

    Returns:
        The lock (keep a reference: the lock is released when the last one is gone), or None when `resume` and the
        directory does not exist.

    Raises:
        RunDirInUse: another process holds the lock.
    """
    run_dir = Path(run_dir)
    if resume and not run_dir.is_dir():
        return None
    key = str(run_dir.resolve())
    held = _HELD.get(key)
    if held is not None and held.held:
        return held
    lock = RunDirLock(run_dir)
    _HELD[key] = lock
    return lock


def release_run_dir(run_dir: str | os.PathLike) -> None:
    """Release this process's lock on `run_dir` (nothing when it holds none): the lock ends with its run."""
    held = _HELD.get(str(Path(run_dir).resolve()))
    if held is not None:
        held.release()


def _read_holder(path: Path, raw: bool = False) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")[:512].strip()
    except OSError:
        text = ""
    if raw:
        return text
    return f"another process ({text})" if text else "another process"


# --- SIGTERM and Ctrl-C ------------------------------------------------------------------------------------------
class Interrupted(BaseException):
    """The run stopped on a signal; `exit_status` is what the process exits with (128 + the signal's number).

    A BaseException, as KeyboardInterrupt: code that handles its own faults (``except Exception``, a sampler's retry)
    must not swallow it.

    Args:
        signum: The signal (SIGTERM or SIGINT).
        step: Steps done when the run stopped; None when it stopped during setup.
        checkpoint: The checkpoint to resume from (None when none was written or this rank writes none).
        final: The final model, when the stop came after it was saved (during the held-out evaluation).
    """

    def __init__(
        self, signum: int, step: int | None = None, checkpoint: Path | None = None, *, final: Path | None = None
    ) -> None:
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        self.final = final
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_status(self) -> int:
        """128 + the signal's number: 143 for SIGTERM, 130 for SIGINT, as a shell reports a process they ended."""
        return 128 + self.signum

    def message(self, command: str) -> str:
        """The one line to print: what happened, and the command that continues the run.

        Args:
            command: The command that continues the run (``... --resume --run-dir X``), or for a stop before
                anything was saved, the one that starts it again.
        """
        name = signal.Signals(self.signum).name
        if self.final is not None:
            return (
                f"stopped by {name} during the held-out evaluation after step {self.step} (training done); the final "
                f"model is kept in {self.final}; score it again with: {command}"
            )
        if self.step is None:
            return f"stopped by {name} during setup, before any step; start it again with: {command}"
        if self.checkpoint is None:
            return f"stopped by {name} at step {self.step}; continue from the newest checkpoint with: {command}"
        return f"stopped by {name} after step {self.step} (checkpoint {self.checkpoint}); continue with: {command}"


def _torchrun_launch() -> list[str]:
    """The torchrun launch of this process's ranks, from torchrun's environment: exact on one node (``--standalone``);
    on several, the node count and rendezvous endpoint it shows (other launch flags are the user's to add)."""
    launcher = shlex.split(os.environ.get("REDCODA_LAUNCHER", "torchrun"))  # algos.torchrun sets it
    per_node = os.environ.get("LOCAL_WORLD_SIZE", "1")
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if nodes <= 1:
        return [*launcher, "--standalone", "--nproc-per-node", per_node]
    endpoint = f"{os.environ.get('MASTER_ADDR', 'HOST')}:{os.environ.get('MASTER_PORT', 'PORT')}"
    return [*launcher, "--nnodes", str(nodes), "--nproc-per-node", per_node, "--rdzv-endpoint", endpoint]


def rerun_command(args: Sequence[str], run_dir: str | os.PathLike, *, resume: bool) -> str:
    """The command line that runs this entry point again on `run_dir` (with ``--resume`` when `resume`).

    Args:
        args: The arguments it ran with (without the program); ``--run-dir`` and ``--resume`` among them are
            replaced.
        run_dir: The run directory.
        resume: Whether the command resumes the run.
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = ["python", "-m", spec.name] if spec is not None and spec.name else ["python", sys.argv[0]]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: relaunch the same way
        program = [*_torchrun_launch(), *program[1:]]
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--run-dir":
            skip = True
        elif not arg.startswith("--run-dir=") and arg not in ("--resume", "--no-resume"):
            kept.append(arg)  # --resume-changed and its names stay: naming an unchanged setting is allowed
    return shlex.join([*program, *kept, *(["--resume"] if resume else []), "--run-dir", str(run_dir)])


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


FORWARD_WINDOW_S = 2.0
"""Under torchrun, a second signal this soon after the first is torchrun forwarding the first (Ctrl-C reaches every
worker from the terminal, then again from torchrun), not a user asking to stop at once."""


def _forwarded(since_first: float) -> bool:
    """Whether a repeated signal, `since_first` seconds after the first, is torchrun's forward of it."""
    return "TORCHELASTIC_RUN_ID" in os.environ and since_first < FORWARD_WINDOW_S


class StopSignals:
    """A context in which SIGTERM and SIGINT ask the run to stop instead of ending the process.

    Inside it, the first signal sets `signum` (the training loop stops at the next step's end) or, with `at_once`,
    raises `Interrupted` where the main thread is (setup, where nothing is lost); a second signal ends the process
    with the signal's own default action, without a checkpoint (under torchrun, not one within `FORWARD_WINDOW_S`
    of the first: that is torchrun forwarding a Ctrl-C the rank also got from the terminal). Leaving the context
    restores the handlers it replaced. Outside the main thread, where Python cannot handle signals, the context
    changes nothing.

    Args:
        at_once: Raise `Interrupted` on the first signal instead of setting `signum`.
    """

    def __init__(self, at_once: bool = False) -> None:
        self.at_once = at_once
        self.signum = 0
        """The first signal received (0: none)."""
        self._previous: dict[int, Any] = {}
        self._first = 0.0

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in _STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum and _forwarded(time.monotonic() - self._first):
            logger.info("%s again, from torchrun forwarding it: already stopping after the current step", name)
            return
        if self.signum:
            logger.warning("%s again: stopping at once, without a checkpoint", name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        self._first = time.monotonic()
        if self.at_once:
            raise Interrupted(signum)
        logger.warning("%s: stopping after the current step (again: stop at once, without a checkpoint)", name)


# --- torch's CPU threads ------------------------------------------------------------------------------------------
RECHECK_SECONDS = 30.0
"""The shortest window over which the thread count is re-decided: a burst must keep a core busy for half of it."""

START_SAMPLE_SECONDS = 0.5
"""The load sample the thread count starts from; it decides only until the first re-check."""


@dataclass(frozen=True)
class CpuReading:
    """One reading of the CPU time counters: two readings give the load between them (`others_busy`)."""

    wall: float
    """Monotonic clock, seconds."""
    busy: float
    """CPU seconds the cores have been busy since boot, every process together (the kernel's counters)."""
    total: float
    """CPU seconds the cores have counted since boot, busy or idle."""
    own: float
    """CPU seconds this process (all its threads) has used."""


def read_cpu(stat: str = "/proc/stat") -> CpuReading | None:
    """Read the kernel's CPU time counters and this process's CPU time (Linux); None where they cannot be read."""
    try:
        with open(stat) as f:
            fields = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    if len(fields) < 5:
        return None
    total = sum(fields) / ticks
    busy = total - (fields[3] + fields[4]) / ticks
    return CpuReading(wall=time.monotonic(), busy=busy, total=total, own=time.process_time())


def others_busy(start: CpuReading, end: CpuReading, cores: int) -> float | None:
    """The average number of cores other processes kept busy between two readings (None for an empty window).

    The busy share of the counted CPU time, times `cores`, less what this process used. Every second of the window
    counts, so a burst weighs by its length: a 1-second spike of one core over a 30-second window is 0.03 cores.
    """
    wall, total = end.wall - start.wall, end.total - start.total
    if wall <= 0 or total <= 0:
        return None
    return max(0.0, cores * (end.busy - start.busy) / total - (end.own - start.own) / wall)


def choose_threads(cores: int, others: float) -> int:
    """The rule: every core that other processes leave idle, rounding their load to the nearest core, at least one.

    One thread per process beats several when the cores are contended (OpenMP threads spin-wait on each other),
    while on an idle machine every core helps.

    Args:
        cores: The machine's cores.
        others: Cores other processes kept busy on average (`others_busy`).
    """
    return max(1, min(cores, cores - int(others + 0.5)))


class TorchThreads:
    """torch's CPU thread count for a run: ``--torch-threads`` when given, else chosen from the load and re-checked.

    The automatic choice starts from a short sample (`START_SAMPLE_SECONDS`) and is decided again between steps,
    once at least `recheck_s` seconds have passed since the last decision, from the average load other processes
    put on the cores over that whole window (`others_busy`, `choose_threads`): a spike at start decides only until
    the first re-check, and a burst later counts by its share of the window. The reading costs two small file
    reads and no waiting. Each change is logged; `describe` is the summary's line.

    Args:
        requested: ``--torch-threads``; None chooses automatically.
        recheck_s: The shortest window between two decisions.
        cores: The machine's cores (None: ``os.cpu_count()``).
        stat: The kernel's CPU counters.
        start: The two readings the first choice is made from; None reads the counters `START_SAMPLE_SECONDS` apart.
        apply: Set ``torch.set_num_threads`` (tests of the rule leave it alone).
    """

    def __init__(
        self,
        requested: int | None,
        *,
        recheck_s: float = RECHECK_SECONDS,
        cores: int | None = None,
        stat: str = "/proc/stat",
        start: tuple[CpuReading | None, CpuReading | None] | None = None,
        apply: bool = True,
    ) -> None:
        self.requested = requested
        self.recheck_s = recheck_s
        self.cores = cores or os.cpu_count() or 1
        self.stat = stat
        self.apply = apply
        self.changes = 0
        self.held: str | None = None
        """Why the count no longer follows the load: another library holds torch's threads (vLLM's CPU engine binds
        its OpenMP threads and makes ``torch.set_num_threads`` a no-op); None while the re-checks decide it."""
        self._last: CpuReading | None = None
        if requested:
            self.threads, self.reason = requested, "--torch-threads"
        else:
            if start is None:
                first = read_cpu(stat)
                time.sleep(START_SAMPLE_SECONDS)
                start = first, read_cpu(stat)
            first, self._last = start
            others = others_busy(first, self._last, self.cores) if first and self._last else None
            if others is not None:
                measured = f"other processes kept {others:.1f} of {self.cores} cores busy over "
                measured += f"{self._last.wall - first.wall:.1f} s; re-checked every {self.recheck_s:g} s between steps"
            else:  # no counters (not Linux): the load average, minutes behind, is all there is
                try:
                    others = os.getloadavg()[0]
                except OSError:
                    others = 0.0
                self._last = None  # nothing to re-check from
                measured = f"load average {others:.1f} of {self.cores} cores"
            self.threads = choose_threads(self.cores, others)
            self.reason = f"automatic: {measured}"
        self.first = self.threads
        self._set()
        logger.info("torch threads: %d (%s)", self.threads, self.reason)

    def recheck(self, now: CpuReading | None = None) -> bool:
        """Decide again if the window since the last decision is long enough; returns whether the count changed.

        Args:
            now: The reading to decide from (None reads the counters now).
        """
        if self.requested or self._last is None or self.held is not None:
            return False
        if self._taken():
            return False
        now = now or read_cpu(self.stat)
        if now is None or now.wall - self._last.wall < self.recheck_s:
            return False
        others = others_busy(self._last, now, self.cores)
        window = now.wall - self._last.wall
        self._last = now
        if others is None:
            return False
        threads = choose_threads(self.cores, others)
        if threads == self.threads:
            return False
        logger.info(
            "torch threads: %d -> %d (other processes kept %.1f of %d cores busy over the last %.0f s)",
            self.threads,
            threads,
            others,
            self.cores,
            window,
        )
        self.threads = threads
        self.changes += 1
        self._set()
        if self._taken():  # the call did nothing: another library holds the threads
            self.changes -= 1
            return False
        return True

    def describe(self) -> str:
        """The summary's line: the count at the end and how it was chosen."""
        if self.held is not None:
            return f"{self.threads} ({self.held})"
        if self.requested:
            return f"{self.threads} (--torch-threads)"
        changed = f"{self.first} at start, changed {self.changes} time(s)" if self.changes else "unchanged"
        return f"{self.threads} (automatic, re-checked every {self.recheck_s:g} s: {changed})"

    def _set(self) -> None:
        if self.apply:
            import torch

            torch.set_num_threads(self.threads)

    def _taken(self) -> bool:
        """Whether torch's thread count is no longer this object's to set (then `held` says why, logged once).

        vLLM's CPU engine binds its OpenMP threads to the cores when it is built and replaces
        ``torch.set_num_threads`` by a no-op that warns on each call, so once that function is not torch's own, or the
        count torch reports differs from the one set here, re-checking would only log changes that do not happen:
        the count torch reports is kept.
        """
        if not self.apply:
            return False
        import sys

        import torch

        actual = torch.get_num_threads()
        replaced = torch.set_num_threads is not torch._C.set_num_threads  # vLLM's CPU worker swaps in a no-op
        if actual == self.threads and not replaced:
            return False
        holder = "vLLM's CPU engine" if "vllm" in sys.modules else "another library"
        self.held = f"held by {holder}: torch.set_num_threads has no effect, so the load is no longer re-checked"
        logger.info("torch threads: %d, %s (this run had set %d)", actual, self.held, self.threads)
        self.threads = actual
        return True
