"""The algorithm registry: one table of names, one precedence rule for settings, and a plug-in from outside the
repository trained through the same command line and through `benchmarks.compare`.

The plug-in is RLOO's leave-one-out baseline (Ahmadian et al. 2024, arXiv 2402.14740) as an estimator: each
episode's advantage is its reward minus the mean of the other episodes of its group; and an algorithm that names it.
They live in a temporary directory with an installed distribution's metadata (a ``.dist-info`` folder whose
``entry_points.txt`` names them in the ``redcoda.objectives`` and ``redcoda.algorithms`` groups), exactly as a
package installed with pip would, and the subprocesses find them on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from algos.config import Config, preset_config
from algos.objectives.weighting import RED, FixedSFT, NoSFT
from algos.presets import PRESETS
from algos.registry import Algorithm, UnknownAlgorithm, algorithm, algorithm_names, register_algorithm
from algos.run.cli import parse_config
from algos.run.training_run import make_weighting

ROOT = Path(__file__).resolve().parents[1]

LOO_ESTIMATOR = '''
import torch
from algos.objectives import Advantages, Estimator, StepInput, register_advantage


def loo(step: StepInput) -> Advantages:
    """RLOO: each reward minus the mean of the other rewards of its group (0 for a group of one)."""
    same = step.group_id[:, None] == step.group_id[None, :]  # (B, B)
    count = same.sum(1).float()  # (B,)
    others = (same.float() @ step.rewards - step.rewards) / (count - 1).clamp_min(1)
    adv = torch.where(count > 1, step.rewards - others, torch.zeros_like(step.rewards))
    return Advantages(adv, {"critic/advantages/abs_mean": float(adv.abs().mean()), "loo/max": float(adv.max())})


def register():
    register_advantage(Estimator("loo", loo, groups=True))
'''
"""The estimator from outside: one small function and one registration (its entry point names `register`)."""

RLOO_ALGORITHM = """
from algos.registry import Algorithm

RLOO = Algorithm("loo_grpo", learner="algos.learners.trainer:Trainer", label="LOO", advantage="loo")
"""
"""A learner-level plug-in: an algorithm that names the estimator as its own, with its own defaults and label."""


def _plugin_dir(tmp_path: Path) -> Path:
    """A directory holding the RLOO module and the metadata of a distribution that registers it."""
    where = tmp_path / "plugin"
    (where / "rloo_plugin-0.1.dist-info").mkdir(parents=True)
    (where / "loo_estimator.py").write_text(textwrap.dedent(LOO_ESTIMATOR))
    (where / "rloo_plugin.py").write_text(textwrap.dedent(RLOO_ALGORITHM))
    (where / "rloo_plugin-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: rloo-plugin\nVersion: 0.1\n"
    )
    (where / "rloo_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        "[redcoda.algorithms]\nloo_grpo = rloo_plugin:RLOO\n\n[redcoda.objectives]\nloo = loo_estimator:register\n"
    )
    return where


def _run(args: list[str], plugin: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(plugin), str(ROOT)]),
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
    }
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_every_builtin_name_is_registered_with_a_label_and_an_entry_point():
    assert algorithm_names()[:11] == [
        *("grpo", "grpo_sft", "red_grpo", "grpo_expert", "sft", "ppo", "archer"),
        *("rloo", "reinforce_pp", "dr_grpo", "gspo"),
    ]
    for name in algorithm_names()[:11]:
        entry = algorithm(name)
        own = ["-m", f"algos.{name}"] if entry.module else ["-m", "algos.train", "--algo", name]
        assert (
            entry.label
            and entry.command() == own
            and (entry.module is None) == (name in ("rloo", "reinforce_pp", "dr_grpo", "gspo"))
        )
        assert issubclass(entry.config_class(), Config)
        assert callable(entry.learner_class())


def test_an_unknown_name_is_an_error_never_red(capsys):
    with pytest.raises(UnknownAlgorithm, match="unknown algorithm 'red'; registered: grpo, grpo_sft"):
        algorithm("red")
    with pytest.raises(ValueError, match="unknown algorithm 'red'"):
        preset_config("tiny", algo="red")
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--preset", "tiny"], algo="red")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "unknown algorithm 'red'" in err


def test_the_weighting_rule_comes_from_the_table():
    kinds = {name: type(make_weighting(preset_config("tiny", algo=name))) for name in algorithm_names()[:7]}
    assert kinds == {
        "grpo": NoSFT,
        "grpo_sft": FixedSFT,
        "red_grpo": RED,
        "grpo_expert": NoSFT,
        "sft": FixedSFT,
        "ppo": NoSFT,
        "archer": NoSFT,
    }


def test_a_name_is_taken_once_and_checked():
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm(Algorithm("grpo", learner="algos.learners.trainer:Trainer", label="another"))
    with pytest.raises(ValueError, match="lowercase letters"):
        Algorithm("My-Algo", learner="x:y")
    with pytest.raises(ValueError, match="sft_weighting must be one of none, fixed, red"):
        Algorithm("mine", learner="x:y", sft_weighting="dynamic")  # type: ignore[arg-type]


def test_one_precedence_rule_for_every_entry_point(tmp_path):
    """dataclass defaults < preset < the algorithm's defaults < its defaults for the preset < --config < flags."""
    ppo = algorithm("ppo")
    tiny = parse_config(["--preset", "tiny"], algo="ppo")
    assert tiny.rl.group_size == 1  # PPO's default over the tiny preset's 2
    assert tiny.rl.questions_per_step == 4  # PPO's for tiny over PPO's own and the preset's
    assert tiny.optim.lr == PRESETS["tiny"]["lr"]  # nothing of PPO's sets it: the preset's
    assert ppo.defaults_for("cpu")["lr"] == 2e-6
    path = tmp_path / "settings.yaml"
    path.write_text("preset: cpu\nquestions_per_step: 6\n")
    from_file = parse_config(["--config", str(path)], algo="ppo")
    assert from_file.run.preset == "cpu" and from_file.optim.lr == 2e-6  # the file's preset picks PPO's cpu defaults
    assert from_file.rl.questions_per_step == 6  # the file over the algorithm's defaults
    flags = parse_config(["--config", str(path), "--questions-per-step", "5"], algo="ppo")
    assert flags.rl.questions_per_step == 5  # the flags over the file
    (tmp_path / "cpu.yaml").write_text("preset: cpu\n")  # SFT plays no rollouts: questions_per_step is refused
    sft = parse_config(["--config", str(tmp_path / "cpu.yaml")], algo="sft")
    assert (sft.optim.lr, sft.sft.sft_batch_size) == (1e-4, 8)  # SFT's defaults give way to what a preset sets


@pytest.mark.parametrize("algo", ["ppo", "archer", "grpo_expert"])
def test_search_credit_is_refused_where_the_advantages_are_not_the_groups(algo, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--preset", "tiny", "--search-credit", "1"], algo=algo)
    assert exit_info.value.code == 2 and f"--search-credit 1.0 is not honoured by {algo}" in capsys.readouterr().err


def test_a_setting_an_algorithm_cannot_honour_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--preset", "tiny", "--no-advantage-std-scale"], algo="ppo")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "--advantage-std-scale False is not honoured by ppo (--advantage gae" in err
    assert parse_config(["--preset", "tiny"], algo="ppo").rl.advantage_std_scale


def test_a_plugin_trains_through_the_command_line_and_the_comparison(tmp_path):
    """RLOO's estimator, defined and registered outside the repository, trains 2 tiny steps as `python -m algos.train
    --algo grpo --advantage loo`, and the algorithm that names it as its own (group size 3) as a system of
    `benchmarks.compare`; its metrics are in every row."""
    assert len(textwrap.dedent(LOO_ESTIMATOR).strip().splitlines()) <= 15
    plugin = _plugin_dir(tmp_path)
    listed = _run(["-m", "algos.train", "--list"], plugin, tmp_path)
    assert listed.returncode == 0 and "loo_grpo: LOO" in listed.stdout, listed.stderr
    run_dir = tmp_path / "run"
    args = ["-m", "algos.train", "--algo", "grpo", "--advantage", "loo", "--preset", "tiny", "--run-dir", str(run_dir)]
    trained = _run([*args, "--eval-questions", "0"], plugin, tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and all("loo/max" in row for row in rows)
    saved = json.loads((run_dir / "redcoda_config.json").read_text())
    assert saved["algo"] == "grpo" and saved["advantage"] == "loo"
    out = tmp_path / "compare"
    compared = _run(
        ["-m", "benchmarks.compare", "--budget", "tiny", "--algos", "loo_grpo", "--seeds", "1", "--no-baseline"]
        + ["--out", str(out)],
        plugin,
        tmp_path,
    )
    assert compared.returncode == 0, compared.stderr[-2000:]
    assert "loo_grpo" in (out / "table.md").read_text()
    rows = [json.loads(line) for line in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    assert all("loo/max" in row for row in rows)  # the algorithm trained with the plug-in's estimator
    assert "LOO" in next(out.rglob("README.md")).read_text()
    unknown = _run([*args, "--eval-questions", "0", "--advantage", "nope"], plugin, tmp_path)
    assert unknown.returncode == 2 and "--advantage: unknown 'nope'; registered: group" in unknown.stderr
