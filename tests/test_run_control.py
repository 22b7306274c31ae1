"""A run's control on a shared machine: the run directory's lock, SIGTERM and Ctrl-C, the torch thread count.

The lock and signal tests run real processes: a real flock held by another process, real signals sent to a real
tiny training run with the real Lucene retriever (its JVM in the process) and with the pure-Python BM25.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from algos.checkpoints.store import find_latest, load_checkpoint
from algos.run import control as run_control
from algos.run.control import CpuReading, TorchThreads, choose_threads, lock_run_dir, others_busy

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "TOKENIZERS_PARALLELISM": "false",
}
WAIT_S = 600  # a bound against a hung test on a loaded machine, not a speed requirement


# --- the run directory's lock --------------------------------------------------------------------------------------
def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that locks `run_dir` and holds it until killed."""
    code = (
        "import sys, time\n"
        "from algos.run.control import lock_run_dir\n"
        f"lock = lock_run_dir({str(run_dir)!r})\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    return child


def test_a_run_dir_locked_by_another_process_is_refused_until_that_process_dies(tmp_path):
    run_dir = tmp_path / "run"
    child = _holder(run_dir)
    try:
        with pytest.raises(run_control.RunDirInUse, match=rf"in use by another process \(pid {child.pid} on "):
            lock_run_dir(run_dir)
        with pytest.raises(run_control.RunDirInUse, match=rf"pid {child.pid} "):
            lock_run_dir(run_dir, resume=True)
    finally:
        child.kill()  # SIGKILL: no cleanup runs, the lock file stays behind
        child.wait()
    assert f"pid {child.pid} " in (run_dir / run_control.HOLDER_FILE).read_text()
    lock = lock_run_dir(run_dir)  # the kernel dropped the dead process's lock: the stale file is locked again
    try:
        assert (run_dir / run_control.HOLDER_FILE).read_text().startswith(f"pid {os.getpid()} on ")
        assert lock_run_dir(run_dir) is lock  # one process opening its own run directory again shares the lock
    finally:
        lock.release()
    child = _holder(run_dir)  # released: another process can take it
    child.kill()
    child.wait()


def test_a_lock_knows_when_its_directory_was_removed_or_replaced(tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    lock = run_control.RunDirLock(run_dir)
    assert lock.lost() is None
    shutil.rmtree(run_dir)
    assert lock.lost() == f"{run_dir} was removed while this run held it"
    holder = _holder(run_dir)  # another run takes the path: a new directory, a lock file of its own
    try:
        assert lock.lost() == (
            f"{run_dir} was replaced (its lock file is not the one this run locked) while this run held it"
        )
    finally:
        holder.kill()
        holder.wait()
    lock.release()


@pytest.mark.slow  # two whole runs in their own processes
def test_a_paused_run_whose_directory_was_replaced_writes_nothing_into_the_new_one(tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    flags = ["--retriever", "bm25-python", "--save-every", "5", "--torch-threads", "1"]
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(
            [*_train(), *flags, "--steps", "30", "--seed", "1", "--run-dir", str(run_dir)],
            env=ENV,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(lambda: len(_rows(run_dir)) >= 3, first, log)
        first.send_signal(signal.SIGSTOP)
        shutil.rmtree(run_dir)
        second = subprocess.run(
            [*_train(), *flags, "--steps", "6", "--seed", "2", "--run-dir", str(run_dir)],
            env=ENV,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
        assert second.returncode == 0, second.stderr[-3000:]
        rows = (run_dir / "metrics.jsonl").read_text()
        first.send_signal(signal.SIGCONT)
        returncode = first.wait(timeout=WAIT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    output = log.read_text()
    assert returncode == 1, output[-3000:]
    line = _one_line(output, "error: ")
    assert line.startswith(f"error: {run_dir} was replaced (its lock file is not the one this run locked) while ")
    assert (run_dir / "metrics.jsonl").read_text() == rows  # the second run's rows alone
    assert [row["step"] for row in _rows(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert json.loads((run_dir / "redcoda_config.json").read_text())["seed"] == 2
    assert load_checkpoint(find_latest(run_dir / "checkpoints")).step == 6


def test_resuming_a_missing_run_dir_creates_nothing(tmp_path):
    assert lock_run_dir(tmp_path / "none", resume=True) is None
    assert not (tmp_path / "none").exists()


# --- SIGTERM and Ctrl-C ------------------------------------------------------------------------------------------
def _train() -> list[str]:
    return [sys.executable, "-m", "algos.red_grpo", "--preset", "tiny", "--eval-questions", "0"]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for(condition, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert process.poll() is None, f"the run ended early ({process.returncode}):\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def _one_line(output: str, start: str) -> str:
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith(start)]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    ("signum", "retriever"),
    [
        pytest.param(signal.SIGTERM, "bm25", id="SIGTERM-lucene"),
        # the same path with the other signal and without Java: in the slow set, to keep the default run short
        pytest.param(signal.SIGINT, "bm25", id="SIGINT-lucene", marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, "bm25-python", id="SIGTERM-no-java", marks=pytest.mark.slow),
    ],
)
def test_a_signal_stops_after_the_step_saves_it_and_resume_goes_on_from_it(tmp_path, signum, retriever):
    run_dir = tmp_path / "run"
    # bm25 is Lucene in a JVM inside the process; bm25-python has no Java. --torch-threads 2 is honoured and logged
    threads = "2" if retriever == "bm25-python" else "1"
    flags = ["--retriever", retriever, "--steps", "50", "--save-every", "100", "--torch-threads", threads]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        run = subprocess.Popen(
            [*_train(), *flags, "--run-dir", str(run_dir)],
            env=ENV,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(lambda: len(_rows(run_dir)) >= 2, run, log)
        if signum == signal.SIGTERM and retriever == "bm25":
            # while it trains, a second run and a --resume on its directory are refused, touching nothing
            first_row = (run_dir / "metrics.jsonl").read_text().splitlines()[0]
            for extra in ([], ["--resume"]):
                other = subprocess.run(
                    [*_train(), *flags, *extra, "--run-dir", str(run_dir)],
                    env=ENV,
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                    timeout=WAIT_S,
                )
                assert other.returncode == 2, other.stderr[-3000:]
                line = _one_line(other.stderr, "error: ")
                assert f"{run_dir} is in use by another process (pid {run.pid} on " in line
                assert other.stderr.strip().endswith(line)
                assert (run_dir / "metrics.jsonl").read_text().splitlines()[0] == first_row
        run.send_signal(signum)
        returncode = run.wait(timeout=WAIT_S)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    output = log.read_text()
    assert returncode == 128 + signum, output[-3000:]
    assert f"torch threads: {threads} (--torch-threads)" in output
    steps = len(_rows(run_dir))
    assert [row["step"] for row in _rows(run_dir)] == list(range(1, steps + 1))
    latest = find_latest(run_dir / "checkpoints")
    assert latest is not None and load_checkpoint(latest).step == steps  # the last finished step, saved
    resume = f"python -m algos.red_grpo --preset tiny --eval-questions 0 {' '.join(flags)} --resume --run-dir {run_dir}"
    name = signal.Signals(signum).name
    line = _one_line(output, f"stopped by {name}")
    assert line == f"stopped by {name} after step {steps} (checkpoint {latest}); continue with: {resume}"

    # the command it prints goes on from that step (here one step more)
    resumed = subprocess.run(
        [*_train(), *flags, "--resume", "--run-dir", str(run_dir), "--steps", str(steps + 1)],
        env=ENV,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {latest} at step {steps}" in resumed.stderr
    assert [row["step"] for row in _rows(run_dir)] == list(range(1, steps + 2))
    assert load_checkpoint(find_latest(run_dir / "checkpoints")).step == steps + 1
    assert re.search(rf"torch threads +│ {threads} \(--torch-threads\)", resumed.stdout)  # the summary's row


def test_ctrl_c_during_the_held_out_evaluation_keeps_the_final_model_and_exits_130_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    # all 200 dev questions, twice (start and trained model): the scoring outlasts the wait for final/
    flags = ["--retriever", "bm25-python", "--steps", "1", "--eval-questions", "200", "--torch-threads", "1"]
    with open(log, "w") as out:
        run = subprocess.Popen(
            [*_train(), *flags, "--run-dir", str(run_dir)], env=ENV, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        _wait_for(lambda: (run_dir / "final" / "config.json").is_file(), run, log)
        run.send_signal(signal.SIGINT)
        returncode = run.wait(timeout=WAIT_S)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    output = log.read_text()
    assert returncode == 130, output[-3000:]
    assert (run_dir / "final" / "config.json").is_file() and not (run_dir / "eval.json").exists()
    latest = find_latest(run_dir / "checkpoints")
    resume = f"python -m algos.red_grpo --preset tiny --eval-questions 0 {' '.join(flags)} --resume --run-dir {run_dir}"
    assert _one_line(output, "stopped by SIGINT") == (
        f"stopped by SIGINT during the held-out evaluation after step 1 (training done); the final model is kept in "
        f"{run_dir / 'final'}; score it again with: {resume}"
    )
    assert latest is not None and load_checkpoint(latest).step == 1


def test_a_signal_during_setup_ends_the_run_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    with open(log, "w") as out:  # --torch-threads None: the automatic choice, logged at the start of setup
        run = subprocess.Popen(
            [*_train(), "--torch-threads", "None", "--run-dir", str(run_dir)],
            env=ENV,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(lambda: "torch threads: " in log.read_text(), run, log)
        run.send_signal(signal.SIGTERM)
        returncode = run.wait(timeout=WAIT_S)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    output = log.read_text()
    assert returncode == 143, output[-3000:]
    assert "(automatic: other processes kept " in output
    command = f"python -m algos.red_grpo --preset tiny --eval-questions 0 --torch-threads None --run-dir {run_dir}"
    assert _one_line(output, "stopped by SIGTERM") == (
        f"stopped by SIGTERM during setup, before any step; start it again with: {command}"
    )
    assert find_latest(run_dir / "checkpoints") is None


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_jvm_leaves_the_signals_to_python(signum):
    """Lucene's JVM, started after Python's handlers are in place, must not take them over (it would shut the
    process down in the middle of a step): the handler sees the signal and the process goes on."""
    code = (
        "import os, time\n"
        "from algos.run.control import StopSignals\n"
        "from retrievers.jvm import start_jvm\n"
        "with StopSignals() as stop:\n"
        "    start_jvm()\n"
        f"    os.kill(os.getpid(), {int(signum)})\n"
        "    time.sleep(0.1)\n"
        "print('flag', stop.signum, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=WAIT_S)
    assert (done.returncode, done.stdout) == (0, f"flag {int(signum)}\n"), done.stderr[-3000:]


def test_the_rerun_command_replaces_run_dir_and_resume():
    args = ["--preset", "tiny", "--run-dir", "a b", "--resume", "--steps", "3", "--run-dir=c"]
    command = run_control.rerun_command(args, Path("x"), resume=True)
    assert command.endswith("--preset tiny --steps 3 --resume --run-dir x")
    assert run_control.rerun_command(["--no-resume"], Path("x"), resume=False).endswith(" --run-dir x")
    kept = run_control.rerun_command(["--resume-changed", "lr", "--resume"], Path("x"), resume=True)
    assert kept.endswith(" --resume-changed lr --resume --run-dir x")  # the names a resume may change stay


def test_under_torchrun_the_rerun_command_relaunches_with_torchrun(monkeypatch):
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", type("Spec", (), {"name": "algos.grpo_sft"})())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    command = run_control.rerun_command(["--preset", "tiny"], Path("x"), resume=True)
    assert command == "torchrun --standalone --nproc-per-node 2 -m algos.grpo_sft --preset tiny --resume --run-dir x"
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    command = run_control.rerun_command([], Path("x"), resume=True)
    assert command.startswith("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint node0:29500 -m algos.grpo_sft ")
    monkeypatch.setenv("REDCODA_LAUNCHER", "python -m algos.torchrun")  # what algos.torchrun tells its workers
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    command = run_control.rerun_command([], Path("x"), resume=True)
    assert command == "python -m algos.torchrun --standalone --nproc-per-node 8 -m algos.grpo_sft --resume --run-dir x"


def test_under_torchrun_the_forwarded_repeat_of_a_signal_is_the_same_stop(monkeypatch, caplog):
    """Ctrl-C reaches a torchrun worker twice, from the terminal and from torchrun: the repeat must not be taken for
    a second Ctrl-C (stop at once, without a checkpoint). A repeat after the window still is one (not sent here: it
    would end this process)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    caplog.set_level(logging.INFO, logger="algos.run.control")
    with run_control.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # still alive: the handler took it as torchrun's forward
    assert stop.signum == signal.SIGINT
    assert "again, from torchrun forwarding it" in caplog.text
    assert not run_control._forwarded(run_control.FORWARD_WINDOW_S + 0.1)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert not run_control._forwarded(0.0)  # without torchrun a repeat is always the user's


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c-to-the-group", "SIGTERM-to-it"])
def test_algos_torchrun_stops_two_ranks_with_one_checkpoint_one_line_and_the_signal_s_status(tmp_path, signum):
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    flags = ["--preset", "tiny", "--eval-questions", "0", "--steps", "200", "--torch-threads", "1"]
    launch = [sys.executable, "-m", "algos.torchrun", "--standalone", "--nproc-per-node", "2", "-m", "algos.grpo_sft"]
    with open(log, "w") as out:
        run = subprocess.Popen(
            [*launch, *flags, "--run-dir", str(run_dir)],
            env=ENV,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )
    try:
        _wait_for(lambda: len(_rows(run_dir)) >= 2, run, log)
        if signum == signal.SIGINT:
            os.killpg(run.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the launcher and every worker
        else:
            run.send_signal(signal.SIGTERM)
        returncode = run.wait(timeout=WAIT_S)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    output = log.read_text()
    assert returncode == 128 + signum, output[-3000:]
    steps = len(_rows(run_dir))
    latest = find_latest(run_dir / "checkpoints")
    assert latest is not None and load_checkpoint(latest).step == steps
    resume = shlex.join(["python", "-m", "algos.torchrun", *launch[3:], *flags, "--resume", "--run-dir", str(run_dir)])
    name = signal.Signals(signum).name
    assert _one_line(output, f"stopped by {name}") == (
        f"stopped by {name} after step {steps} (checkpoint {latest}); continue with: {resume}"
    )
    assert "Connection closed by peer" not in output and "SignalException" not in output


# --- torch's CPU threads ------------------------------------------------------------------------------------------
def _reading(wall: float, others: float, own: float, cores: int = 2) -> CpuReading:
    """A reading after `wall` seconds during which other processes used `others` CPU seconds and this one `own`."""
    return CpuReading(wall=wall, busy=others + own, total=cores * wall, own=own)


def test_the_rule_leaves_other_processes_their_cores():
    assert [choose_threads(2, load) for load in (0.0, 0.4, 0.6, 1.0, 1.6, 2.0, 5.0)] == [2, 2, 1, 1, 1, 1, 1]
    assert choose_threads(8, 2.2) == 6
    # the load over a window counts every second of it: one core busy for 1 s of 30 s is 1/30 of a core
    assert others_busy(_reading(0, 0, 0), _reading(30, 1.0, 30.0), cores=2) == pytest.approx(1 / 30)
    assert others_busy(_reading(0, 0, 0), _reading(30, 30.0, 30.0), cores=2) == pytest.approx(1.0)
    assert others_busy(_reading(5, 0, 0), _reading(5, 1, 1), cores=2) is None  # an empty window decides nothing


def test_a_spike_at_start_decides_only_until_the_first_recheck(caplog):
    caplog.set_level(logging.INFO, logger="algos.run.control")
    spike = (_reading(0.0, 0.0, 0.0), _reading(0.5, 0.9, 0.0))  # 0.5 s in which another process spun 1.8 cores
    threads = TorchThreads(None, cores=2, recheck_s=30, start=spike, apply=False)
    assert threads.threads == 1
    assert "torch threads: 1 (automatic: other processes kept 1.8 of 2 cores busy over 0.5 s;" in caplog.text
    assert not threads.recheck(_reading(20.5, 0.9, 20.0))  # too short a window: no decision yet
    assert threads.recheck(_reading(40.5, 1.0, 40.0))  # then 0.1 core-s of other work in 40 s: every core again
    assert threads.threads == 2 and "torch threads: 1 -> 2 (other processes kept 0.0 of 2 cores" in caplog.text
    assert not threads.recheck(_reading(80.5, 5.0, 116.0))  # 4 core-s of 40 s: still idle enough
    assert threads.recheck(_reading(120.5, 35.0, 156.0))  # another process on 3/4 of a core for 40 s
    assert threads.threads == 1
    assert threads.describe() == "1 (automatic, re-checked every 30 s: 1 at start, changed 2 time(s))"


def test_torch_threads_given_are_kept_whatever_the_load(caplog):
    import torch

    caplog.set_level(logging.INFO, logger="algos.run.control")
    before = torch.get_num_threads()
    try:
        threads = TorchThreads(3, recheck_s=1)
        assert torch.get_num_threads() == 3 and "torch threads: 3 (--torch-threads)" in caplog.text
        assert not threads.recheck(_reading(1e9, 1e9, 0.0))
        assert torch.get_num_threads() == 3 and threads.describe() == "3 (--torch-threads)"
    finally:
        torch.set_num_threads(before)


def test_threads_held_by_another_library_are_left_alone_and_said_once(monkeypatch, caplog):
    """vLLM's CPU engine binds its OpenMP threads and makes ``torch.set_num_threads`` a no-op: the re-check then stops
    (no change is logged that does not happen) and the summary says who holds the count."""
    import torch

    caplog.set_level(logging.INFO, logger="algos.run.control")
    before = torch.get_num_threads()
    try:
        idle = (_reading(0.0, 0.0, 0.0), _reading(0.5, 0.0, 0.0))
        threads = TorchThreads(None, cores=2, recheck_s=30, start=idle)
        assert threads.threads == 2 == torch.get_num_threads()
        torch.set_num_threads(1)  # an engine's binding, then set_num_threads stops working
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
        caplog.clear()
        assert not threads.recheck(_reading(40.5, 40.0, 40.0))  # whatever the load: the count is not ours to set
        assert threads.threads == 1 and threads.held is not None and threads.changes == 0
        monkeypatch.undo()
        assert torch.get_num_threads() == 1  # (back to torch's own function for the rest)
        fresh = TorchThreads(None, cores=2, recheck_s=30, start=idle)  # binds to the same count as was chosen:
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the replaced function alone tells
        assert not fresh.recheck(_reading(40.5, 40.0, 40.0)) and fresh.held is not None
        monkeypatch.undo()
        torch.set_num_threads(1)
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
        assert "torch threads: 1, held by another library" in caplog.text and "->" not in caplog.text
        caplog.clear()
        assert not threads.recheck(_reading(80.5, 40.0, 80.0)) and not caplog.text  # said once
        assert threads.describe().startswith("1 (held by another library: torch.set_num_threads has no effect")
    finally:
        monkeypatch.undo()
        torch.set_num_threads(before)


def test_the_counters_of_this_machine_read():
    start = run_control.read_cpu()
    assert start is not None and 0 <= start.busy <= start.total and start.own > 0
    assert run_control.read_cpu("/no/such/file") is None
