"""A failed evaluation fails: a dead sampler endpoint, or a server that fails half its calls, ends
`benchmarks.evaluate` (and the trainer's held-out scoring) with one line naming the cause and the count, instead of
a table of zeros; below `--max-error-rate` the table says how many episodes errored."""

from __future__ import annotations

import socket
import threading

import pytest

from agents.evaluation import EvaluationFailed, check_errors, error_counts


@pytest.fixture(scope="module")
def served_tokenizer(tiny, tmp_path_factory):
    """A directory holding the tiny model's tokenizer: what `--model` names for an openai sampler."""
    path = tmp_path_factory.mktemp("served")
    tiny[1].save_pretrained(path)
    return str(path)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed when the socket is: nothing listens there


def _evaluate(argv: list[str], tokenizer_dir: str):
    from benchmarks.evaluate import main

    common = ["--agent", "direct", "--model", tokenizer_dir, "--served-model", "tiny", "--corpus", "distractor"]
    return main([*common, "--sampler", "openai", "--max-new-tokens", "8", *argv])


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_a_dead_endpoint_fails_in_one_line_naming_the_sampler_and_the_count(served_tokenizer, capsys):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    with pytest.raises(SystemExit) as stopped:
        _evaluate(["--limit", "2", "--sampler-url", url], served_tokenizer)
    assert stopped.value.code == 1
    captured = capsys.readouterr()
    [line] = _error_lines(captured.err)
    assert "2 of 2 episodes (100%)" in line and "the sampler in 2" in line and "ConnectError" in line
    assert "Traceback" not in captured.err and "em" not in captured.out  # no table of zeros


@pytest.fixture(scope="module")
def flaky_url(serve_app):
    """An OpenAI-compatible server that answers every other call with a 400 (which the client does not retry)."""
    fastapi = pytest.importorskip("fastapi")
    app, lock, calls = fastapi.FastAPI(), threading.Lock(), [0]

    @app.post("/v1/completions")
    def completions(body: dict) -> dict:
        with lock:
            calls[0] += 1
            fail = calls[0] % 2 == 0
        if fail:
            raise fastapi.HTTPException(400, "this server fails half its calls")
        choice = {"index": 0, "text": "<answer> Paris", "finish_reason": "stop", "logprobs": None}
        return {"id": "cmpl-0", "object": "text_completion", "model": "tiny", "choices": [choice]}

    url, _ = serve_app(app)
    return f"{url}/v1"


def test_a_server_failing_half_its_calls_fails_the_evaluation(served_tokenizer, flaky_url, capsys):
    with pytest.raises(SystemExit) as stopped:
        _evaluate(["--limit", "4", "--sampler-url", flaky_url], served_tokenizer)
    assert stopped.value.code == 1
    [line] = _error_lines(capsys.readouterr().err)
    assert "2 of 4 episodes (50%)" in line and "more than the 5% allowed" in line and "400" in line


def test_below_the_allowed_share_the_table_says_how_many_episodes_errored(served_tokenizer, flaky_url, capsys):
    result = _evaluate(["--limit", "4", "--sampler-url", flaky_url, "--max-error-rate", "0.5"], served_tokenizer)
    assert result["errors"]["episodes"] == result["errors"]["sampler"] == 2 and result["n"] == 4
    out = capsys.readouterr().out
    assert "Episodes with sampler or retriever errors: 2 of 4 (sampler 2, retriever 0)." in out
    assert "Wilson" in out  # the caption names each column's interval
    assert result["metrics"]["answered"]["mean"] == 0.5  # the served half answered


def test_the_count_and_the_check():
    ok = {"sampler_errors": 0, "retrieval_errors": 0}
    predictions = [ok] * 19 + [{"sampler_errors": 0, "retrieval_errors": 2, "error": "ReadTimeout: 5 s"}]
    errors = error_counts(predictions)
    assert errors == {"episodes": 1, "n": 20, "sampler": 0, "retriever": 1, "first": "ReadTimeout: 5 s"}
    check_errors(errors)  # 5% is allowed
    with pytest.raises(EvaluationFailed, match=r"2 of 20 episodes \(10%\).*the retriever in 2.*ReadTimeout"):
        check_errors(error_counts(predictions[1:] + predictions[-1:]))


def test_the_trainers_held_out_scoring_fails_and_the_entry_point_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    import agents.evaluation
    from algos.config import preset_config
    from algos.run import launch
    from algos.run.evaluation import score_held_out

    scores = dict.fromkeys(agents.evaluation.METRICS, 0.0)  # what an errored episode scores
    failed = [
        {"index": i, "sampler_errors": 0, "retrieval_errors": 1, "error": "ConnectError: refused", **scores}
        for i in range(3)
    ]
    monkeypatch.setattr(agents.evaluation, "evaluate", lambda *a, **k: {"n": 3, "predictions": failed})
    config = preset_config("tiny", algo="grpo", run_dir=str(tmp_path / "run"), eval_questions=3)
    with pytest.raises(EvaluationFailed, match="3 of 3 episodes.*the retriever in 3"):
        score_held_out("a model", config)
    tolerant = preset_config(
        "tiny", algo="grpo", run_dir=str(tmp_path / "run"), eval_questions=3, max_eval_error_rate=1
    )
    assert score_held_out("a model", tolerant)["errors"]["episodes"] == 3  # --max-eval-error-rate 1: reported, kept

    class DeadRetrieverRun:  # a run whose held-out evaluation meets a dead retrieval server
        def __init__(self, config):
            self.config = config

        def train(self):
            return score_held_out("a model", self.config)

        def close(self):
            pass

    monkeypatch.setattr(launch, "TrainingRun", DeadRetrieverRun)
    with pytest.raises(SystemExit) as stopped:
        launch.main(["--preset", "tiny", "--run-dir", str(tmp_path / "run")], algo="grpo")
    assert stopped.value.code == 1
    [line] = _error_lines(capsys.readouterr().err)
    assert "3 of 3 episodes (100%)" in line and "ConnectError: refused" in line
