"""Export: `python -m envs.export` writes Search-R1 and FlashRAG files that Search-R1's trainer reads and that read
back through ``data_path`` as the same questions."""

from __future__ import annotations

import json

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the RedCoda-* ids)


def make(env_id: str = "RedCoda-HotpotQA-v0", **kwargs):
    return gym.make(env_id, **kwargs)


@pytest.mark.parametrize(
    ("fmt", "suffix"),
    [("search-r1", ".parquet"), ("search-r1", ".jsonl"), ("flashrag", ".jsonl"), ("flashrag", ".parquet")],
)
def test_exported_search_r1_and_flashrag_files_read_back_as_the_same_questions(tmp_path, fmt, suffix):
    import subprocess
    import sys

    if suffix == ".parquet":
        pytest.importorskip("pyarrow", reason="parquet files need pyarrow (pip install pyarrow)")
    out = tmp_path / f"hotpotqa_dev{suffix}"
    subprocess.run(
        [sys.executable, "-m", "envs.export", "--split", "dev", "--format", fmt, "--out", str(out)], check=True
    )
    original = make(split="dev").unwrapped.examples
    env = make(data_path=str(out))
    read = env.unwrapped.examples
    questions = [e.question for e in original]
    if fmt == "search-r1":  # as Search-R1's nq_search.py writes them: stripped, ending with "?"
        questions = [q.strip() if q.strip().endswith("?") else q.strip() + "?" for q in questions]
        assert questions != [e.question for e in original]  # 5 dev questions lack the "?"
    assert [(e.id, e.question, e.answers) for e in read] == [
        (e.id, q, e.answers) for e, q in zip(original, questions, strict=True)
    ]
    obs, info = env.reset(options={"index": 7})
    assert original[7].question in obs
    *_, info = env.step(f"<answer>{original[7].answer}</answer>")
    assert info["f1"] == 1.0


SEARCH_R1_DATA_SOURCES = {"nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"}
"""The `data_source` names Search-R1's reward dispatcher (`_select_rm_score_fn`) scores; any other raises there."""


@pytest.mark.parametrize(
    ("dataset", "split", "source"),
    [
        ("hotpotqa", "dev", "hotpotqa"),
        ("musique", "dev", "musique"),
        ("2wiki", "dev", "2wikimultihopqa"),
        ("bamboogle", "test", "bamboogle"),
    ],
)
def test_search_r1_export_names_each_dataset_as_search_r1_does(tmp_path, dataset, split, source):
    from envs.data import load_examples
    from envs.export import main

    out = tmp_path / f"{dataset}.jsonl"
    main(["--dataset", dataset, "--split", split, "--format", "search-r1", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {row["data_source"] for row in rows} == {source} and source in SEARCH_R1_DATA_SOURCES
    for row in rows:
        assert row["question"].endswith("?") and row["question"] == row["question"].strip()
        assert row["prompt"][0]["content"].endswith(f"Question: {row['question']}\n")
    read = load_examples(dataset, split, str(out))
    assert {e.dataset for e in read} == {dataset}  # Search-R1's name reads back as ours
    assert [e.answers for e in read] == [e.answers for e in load_examples(dataset, split)]


def test_search_r1_rows_with_only_a_reward_target_load(tmp_path):
    row = {
        "data_source": "nq",
        "prompt": [{"role": "user", "content": "Question: who wrote Hamlet?"}],
        "question": "who wrote Hamlet?",
        "reward_model": {"style": "rule", "ground_truth": {"target": ["William Shakespeare", "Shakespeare"]}},
        "extra_info": {"split": "train", "index": 0},
    }
    path = tmp_path / "nq.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (example,) = make(data_path=str(path)).unwrapped.examples
    assert example.answers == ("William Shakespeare", "Shakespeare") and example.dataset == "nq"
    assert example.id == "0"
