"""The evaluation harness (tiny model, real BM25, bundled dev questions); its intervals: tests/test_stats.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agents.evaluation import METRICS, evaluate, extract_answer, format_table


def test_answers_are_extracted_from_tags_or_taken_whole():
    assert extract_answer("<think>hm</think><answer> Paris </answer>") == ("Paris", True)
    assert extract_answer("It is Paris.") == ("It is Paris.", False)
    assert extract_answer("<answer>Paris") == ("Paris", False)


@pytest.fixture(scope="module")
def tiny():
    from agents.models import tiny_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model(seed=0)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("agent", ["direct", "rag", "search_r1", "coda", "oracle"])
def test_evaluate_scores_every_question(agent, tiny, bm25, tmp_path):
    out = tmp_path / f"{agent}.jsonl"
    result = evaluate(agent, tiny, "dev", limit=3, batch=2, max_new_tokens=6, max_turns=2, out=out, progress=False)
    assert result["n"] == 3 and set(result["metrics"]) == set(METRICS)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    for name in METRICS:
        values = [r[name] for r in records]
        assert result["metrics"][name]["mean"] == pytest.approx(np.mean(values))
    if agent == "oracle":
        assert all(r["f1"] == 1.0 for r in records)
    else:
        assert all(
            0.0 <= r["f1"] <= 1.0 and r["invalid_actions"] == 1.0 for r in records
        )  # a random model writes no tags
    assert {"direct": 0, "rag": 1}.get(agent, records[0]["num_searches"]) == records[0]["num_searches"]
    assert agent in format_table([result])


def test_the_command_line_scores_a_slice_and_writes_the_whole_result(tiny, tmp_path):
    """--first 2 --limit 2 scores dev 2-3; --result writes metrics, predictions and the env settings first_search
    reads; --first without --limit is refused in one line."""
    from benchmarks.evaluate import main as evaluate_main

    model, tokenizer = tiny
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    path = tmp_path / "result.json"
    argv = ["--agent", "coda", "--model", str(tmp_path / "tiny"), "--threads", "1", "--max-new-tokens", "4"]
    argv += ["--first", "2", "--limit", "2"]
    evaluate_main([*argv, "--result", str(path)])
    written = json.loads(path.read_text())
    assert [p["index"] for p in written["predictions"]] == [2, 3] and written["n"] == 2
    assert written["settings"]["agent"] == "coda" and "split" in written["settings"]["env_kwargs"]
    record = written["provenance"]  # envs.provenance: the model directory and the dev questions hashed
    assert record["seed"] == 0 and record["model"]["hash"]
    assert record["data"]["questions"]["file"] == "bundled:hotpotqa/dev"
    with pytest.raises(SystemExit) as stop:
        evaluate_main(["--agent", "coda", "--first", "2"])
    assert stop.value.code == 2


def test_first_search_splits_an_evaluation_into_reading_and_searching(tmp_path, capsys):
    """Dev 1's answer stands in what its question-as-query search shows ("Carver Dana Andrews", Doc 2); dev 3's and
    dev 56's do not, but dev 56's second query ("Chris Wood") shows it ("New Zealand national team"), dev 3's second
    ("Boyzone") does not; dev 9 is a yes/no question."""
    from algos.config import preset_config
    from algos.run.evaluation import held_out_settings
    from envs.first_search import main as first_search

    settings = held_out_settings(preset_config("cpu", protocol="flat"))

    def searches(*queries):
        return [f"<think>I need to search.</think>\n<search>{q}</search>" for q in queries]

    predictions = [
        {"index": 1, "gold_answers": ["Carver Dana Andrews"], "f1": 1.0, "num_searches": 1, "actions": searches("x")},
        {"index": 3, "gold_answers": ["25 million"], "f1": 0.0, "num_searches": 2, "actions": searches("x", "Boyzone")},
        {"index": 56, "gold_answers": ["New Zealand national team"], "f1": 0.0, "num_searches": 2,
         "actions": searches("x", "Chris Wood")},
        {"index": 9, "gold_answers": ["yes"], "f1": 1.0, "num_searches": 1, "actions": searches("x")},
    ]  # fmt: skip
    run = tmp_path / "run"
    run.mkdir()
    before = [{**p, "f1": 0.0, "num_searches": 0, "actions": []} for p in predictions]
    (run / "eval.json").write_text(
        json.dumps(
            {
                "after": {"settings": settings, "predictions": predictions},
                "before": {"settings": settings, "predictions": before},
            }
        )  # fmt: skip
    )
    rows = first_search([str(run / "eval.json")])
    trained, start = rows["run (trained)"], rows["run (start)"]
    assert (trained["shown"]["n"], trained["shown"]["f1"], trained["shown"]["searched_again"]) == (1, 1.0, 0.0)
    hidden = trained["not shown"]
    assert (hidden["n"], hidden["f1"], hidden["searched_again"], hidden["found_later"]) == (2, 0.0, 1.0, 0.5)
    assert trained["yes/no"]["n"] == 1 and start["shown"]["f1"] == 0.0 and start["not shown"]["found_later"] == 0.0
    printed = capsys.readouterr().out
    assert "| run (trained) | 1, 1.000" in printed
    # by question type: dev 1, 3 and 56 are bridge questions, dev 9 a yes/no comparison; dev 2 ("Which is a French
    # documentary, The Seine Meets Paris and Great Old Amusement Parks?") names its answer, dev 20 ("plants") not
    kinds = trained["by kind"]
    assert kinds["bridge"]["n"] == 3 and kinds["bridge"]["f1"] == pytest.approx(1 / 3) and kinds["yes/no"]["n"] == 1
    assert "comparison: one of the two named" not in kinds
    assert "| run (trained) | 3, 0.333 [" in printed
    from envs.first_search import split_tables

    tables, numbers = split_tables({"one": {"settings": settings, "predictions": predictions[:1]}})
    assert numbers["one"]["not shown"]["n"] == 0 and numbers["one"]["yes/no"]["f1"] is None
    assert "| one | 1, 1.000 [" in tables and tables.splitlines()[2].endswith("| 0 | 0 |")
    from envs.first_search import by_kind, question_kinds

    more = {"settings": settings, "predictions": [{"index": 2, "f1": 0.5}, {"index": 20, "f1": 0.0}]}
    assert question_kinds(more) == {2: "comparison: one of the two named", 20: "comparison: other"}
    assert by_kind(more, question_kinds(more))["comparison: one of the two named"]["f1"] == 0.5


def test_the_second_query_bound_counts_what_one_more_search_finds(bm25):
    """Each question counted as found misses the answer with the question as the query and shows it with the gold
    title the first results or the question name; wider passages never add first-miss questions."""
    import gymnasium as gym

    from agents.oracle import base_title
    from benchmarks.investigations.second_query_bound import bound, main
    from envs.first_search import shows_answer

    kwargs = {"split": "dev", "retriever": bm25, "top_k": 3, "max_passage_words": 40}
    result = bound(kwargs, range(40))
    assert result["questions"] >= result["first_miss"] >= result["named"] >= result["found"] >= 1
    assert result["share_found"] == result["found"] / result["first_miss"]
    env = gym.make("RedCoda-HotpotQA-v0", protocol="flat", **kwargs)
    for index in result["found_indices"]:
        example = env.unwrapped.examples[index]
        env.reset(options={"index": index})
        first, *_ = env.step(f"<search>{example.question}</search>")
        assert not shows_answer(first, example.answers)
        shown = [base_title(title) for title in example.gold_titles]
        assert any(title in first or title in example.question for title in shown)
    env.close()
    wider = bound({**kwargs, "top_k": 5, "max_passage_words": 80}, range(40))
    assert wider["questions"] == result["questions"] and wider["first_miss"] <= result["first_miss"]
    with pytest.raises(ValueError, match="outside the split"):
        bound(kwargs, [10**6])
    with pytest.raises(SystemExit):
        main(["--limit", "0"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--limit", "0"], "--limit must be >= 1"),
        (["--limit", "-1"], "--limit must be >= 1"),
        (["--sampler", "openai"], "--sampler openai needs --sampler-url"),
        (["--model", "{empty}"], "holds no config.json"),
        (["--model", "{missing}"], "no model at"),
    ],
)
def test_evaluate_refuses_bad_input_in_one_line_before_anything_loads(argv, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    argv = [a.format(empty=tmp_path / "empty", missing=tmp_path / "missing") for a in argv]
    from benchmarks.evaluate import main as evaluate_main

    with pytest.raises(SystemExit) as exit_info:
        evaluate_main(["--agent", "search_r1", "--corpus", "distractor", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and sum("error: " in line for line in lines) == 1, err
    assert message in lines[-1], err
