"""Command lines that cannot run end with one line, ``error: ...`` naming the flag or the file, and exit status 2:
settings refused at parse time, corpus and data files refused at start (naming the file and the line), a resume
with other weights than the checkpoint's, and the retrieval server's own command line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from algos.config import Config, preset_config
from algos.run.cli import parse_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
DISTRACTOR = ["--corpus", "distractor"]
"""Each question's own paragraphs: no index to build where the corpus does not matter."""


def _one_line(err: str) -> str:
    """The last line of stderr, which must be the only ``error:`` line, with no traceback before it."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert sum(line.startswith("error: ") for line in lines) == 1, err
    return lines[-1]


def _refused(argv: list[str], capsys) -> str:
    """Parse `argv` (tiny preset) and return the one-line usage error it must end with."""
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--preset", "tiny", *argv], algo="red_grpo")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


# --- settings ------------------------------------------------------------------------------------------------------
def _float_fields() -> list[tuple[str, int]]:
    """Every float setting of `Config` as (flag, how many numbers it takes)."""
    out = []
    for name, hint in Config.flat_types().items():
        args = typing.get_args(hint)
        if hint is float or (float in args and type(None) in args):
            out.append((f"--{name.replace('_', '-')}", 1))
        elif typing.get_origin(hint) is tuple and args and all(a is float for a in args):
            out.append((f"--{name.replace('_', '-')}", len(args)))
    return out


def test_every_float_setting_is_covered():
    flags = {flag for flag, _ in _float_fields()}
    assert {"--lr", "--weight-decay", "--kl-coef", "--red-max-factor", "--adam-betas", "--retriever-timeout"} <= flags
    assert "--dist-timeout-seconds" in flags


@pytest.mark.parametrize(("flag", "count"), _float_fields())
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_no_float_setting_may_be_infinite_or_nan(flag, count, value, capsys):
    line = _refused([flag, *([value] * count)], capsys)
    assert line.startswith(f"error: {flag} must be "), line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "abc"], "error: Error parsing --steps: invalid literal for int() with base 10: 'abc'"),
        (["--protocol", "nope"], "error: invalid choice 'nope' for argument '--protocol'"),
        (["--lr"], "error: Missing value for argument '--lr'"),
        (["--bogus"], "error: Unrecognized options: --bogus"),
        (["--adam-betas", "1.5", "0.9"], "error: --adam-betas must be two numbers in [0, 1), got (1.5, 0.9)"),
        (["--adam-betas", "0.9", "-0.1"], "error: --adam-betas must be two numbers in [0, 1)"),
        (["--weight-decay", "inf"], "error: --weight-decay must be a finite number, got inf"),
        (["--kl-coef", "inf"], "error: --kl-coef must be a finite number, got inf"),
        (["--red-max-factor", "inf"], "error: --red-max-factor must be a finite number, got inf"),
        (["--lr", "inf"], "error: --lr must be a finite number, got inf"),
        (["--lr", "nan"], "error: --lr must be a finite number, got nan"),
        (["--lora-alpha", "0"], "error: --lora-alpha must be > 0"),
        (["--lora-alpha", "-16"], "error: --lora-alpha must be > 0"),
        (["--dist-timeout-seconds", "0"], "error: --dist-timeout-seconds must be > 0"),
        (["--retriever", "bogus-kind"], "error: --retriever must be one of bm25, bm25-matrix, bm25-python, dense,"),
        (["--max-context-tokens", "8"], "error: --max-context-tokens must be at least 107 (the search-r1 instructions"),
        (["--max-context-tokens", "50", "--protocol", "coda", "--instructions", "short"], "must be at least 53"),
        (["--eval-split", "nope"], "error: --eval-split 'nope': hotpotqa has no bundled split of that name; bundled:"),
        (["--split", "nope", "--eval-questions", "0"], "error: --split 'nope': hotpotqa has no bundled split"),
        (["--env", "RedCoda-Nope-v0"], "error: --env 'RedCoda-Nope-v0' is not a registered env; the registered"),
        (["--device", "bogus"], "error: --device 'bogus' is not a torch device"),
        (["--seed", "-1"], "error: --seed must be in [0, 2**32) (NumPy's seeds), got -1"),
        (["--seed", "1099511627776"], "error: --seed must be in [0, 2**32)"),
        (["--data-path", "/no/such/file.json", "--eval-questions", "0"], "error: --data-path '/no/such/file.json': no"),
        (["--sft-data", "/no/such/demos.jsonl"], "error: --sft-data '/no/such/demos.jsonl': no such file"),
        (["--resume-changed", "lr", "nope"], "error: --resume-changed names no setting: nope"),
        (
            ["--rollout", "tree", "--group-size", "3"],
            "error: --rollout tree: --group-size (3) must be --tree-roots (2)",
        ),
    ],
)
def test_settings_that_cannot_run_are_refused_at_parse_time(argv, message, capsys):
    assert message in _refused(argv, capsys)


@pytest.mark.parametrize(
    ("make", "argv", "message"),
    [
        (lambda d: d.mkdir(), [], "holds no config.json: not a model directory"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "llama", ')), [], "not a valid JSON"),
        (lambda d: None, [], "no model at"),
        (lambda d: None, ["--model", "tiny", "--lora", "--lora-target-modules", "q_proj", "nope"], "nope: no linear"),
    ],
    ids=["empty-directory", "broken-config", "missing-path", "lora-target"],
)
def test_a_model_that_cannot_load_or_a_lora_target_it_lacks_is_refused_before_any_weight_loads(
    make, argv, message, tmp_path, capsys
):
    model = tmp_path / "model"
    make(model)
    err = _refused(argv or ["--model", str(model)], capsys)
    assert message in err, err
    assert err.startswith("error: --model " if not argv else "error: --lora-target-modules "), err


def test_lora_targets_are_checked_against_the_model_s_own_layers(capsys):
    config = parse_config(["--preset", "tiny", "--lora", "--lora-target-modules", "q_proj", "mlp.up_proj"], algo="grpo")
    assert config.model.lora_target_modules == ("q_proj", "mlp.up_proj")
    err = _refused(["--lora", "--lora-target-modules", "mlp"], capsys)  # a block, not a layer LoRA adapts
    assert "its layers: down_proj, embed_tokens, gate_proj" in err, err


def test_server_urls_and_every_retriever_kind_pass():
    from retrievers.factory import RETRIEVER_KINDS

    for retriever in (*RETRIEVER_KINDS, "http://127.0.0.1:8000", "https://search.example.org/retrieve"):
        assert parse_config(["--preset", "tiny", "--retriever", retriever], algo="grpo").env.retriever == retriever


def test_a_context_too_small_for_the_demonstrations_is_refused_at_start_with_the_length_that_fits(tmp_path, capsys):
    """Over the words floor that parsing checks, under the demonstrations' real token count: refused in one line that
    gives the length which keeps one."""
    from algos import grpo_sft

    with pytest.raises(SystemExit) as exit_info:
        grpo_sft.main(["--preset", "tiny", "--run-dir", str(tmp_path), "--max-context-tokens", "120", *DISTRACTOR])
    assert exit_info.value.code == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: --max-context-tokens 120 is shorter than every demonstration in "), line
    shortest = int(line.rsplit("--max-context-tokens ", 1)[1].split()[0])
    assert shortest > 120


# --- corpus and data files -----------------------------------------------------------------------------------------
GOOD_ROW = {"id": "a", "contents": '"Ed Wood"\nEdward Davis Wood Jr. was an American filmmaker.'}
BAD_CORPORA = {
    "bad JSON": ([json.dumps(GOOD_ROW), '{"id": "b", "contents": '], "line 2: not valid JSON (Expecting value)"),
    "a list": ([json.dumps(GOOD_ROW), "[1, 2]"], "line 2: expected a JSON object (one passage), got a list"),
    "list contents": ([json.dumps({"id": "b", "contents": ["x"]})], "line 1: 'contents' must be a string, got list"),
    "int title": ([json.dumps({"id": "b", "contents": "x", "title": 7})], "line 1: 'title' must be a string, got int"),
    "no contents": ([json.dumps({"id": "b"})], "line 1: the row has neither 'contents' nor 'text'"),
    "null id": ([json.dumps({"id": None, "contents": "x"})], "line 1: 'id' must be a string or an integer, got null"),
    "duplicate ids": ([json.dumps(GOOD_ROW), "", json.dumps(GOOD_ROW)], "line 3: id 'a' is also line 1's id"),
    "empty": ([], "the corpus file holds no rows"),
}


@pytest.mark.parametrize("fault", list(BAD_CORPORA))
def test_a_bad_corpus_file_stops_the_trainer_in_one_line_naming_the_file_and_line(fault, tmp_path, capsys):
    from algos import grpo

    lines, message = BAD_CORPORA[fault]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(["--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--corpus-path", str(corpus)])
    assert exit_info.value.code == 2
    assert _one_line(capsys.readouterr().err) == f"error: {corpus}: {message}"


def test_a_damaged_gzip_corpus_names_the_file(tmp_path):
    import gzip

    from retrievers.corpus import Corpus, CorpusError

    corpus = tmp_path / "corpus.jsonl.gz"
    corpus.write_bytes(gzip.compress(((json.dumps(GOOD_ROW) + "\n") * 200).encode())[:60])
    with pytest.raises(CorpusError, match=f"^{corpus}: line 1: cannot be read .*damaged or truncated"):
        Corpus.from_jsonl(corpus)


def test_a_question_that_is_not_text_names_the_data_file_and_line(tmp_path):
    from envs.data import DataError, load_examples

    data = tmp_path / "questions.jsonl"
    row = {"_id": "q", "question": "Who?", "answer": "x", "context": [], "supporting_facts": []}
    data.write_text(json.dumps(row) + "\n" + json.dumps({**row, "question": ["Who?"]}) + "\n")
    with pytest.raises(DataError, match=r"questions.jsonl: line 2: 'question' must be a non-empty string"):
        load_examples("hotpotqa", path=data)


def test_a_corpus_error_in_a_fresh_process_prints_no_traceback(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps(GOOD_ROW) + "\n[1, 2]\n")
    command = [sys.executable, "-m", "algos.grpo", "--preset", "tiny", "--run-dir", str(tmp_path / "run")]
    done = subprocess.run(
        [*command, "--corpus-path", str(corpus)], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert _one_line(done.stderr) == f"error: {corpus}: line 2: expected a JSON object (one passage), got a list"


# --- resuming with other weights -----------------------------------------------------------------------------------
@pytest.mark.parametrize("saved_with_lora", [False, True])
def test_resuming_with_the_other_lora_setting_is_refused_in_one_line(saved_with_lora, tmp_path, capsys):
    from algos import grpo

    lora = ["--lora"] if saved_with_lora else []
    flags = ["--preset", "tiny", "--run-dir", str(tmp_path), "--eval-questions", "0", *DISTRACTOR]
    grpo.main([*flags, "--steps", "1", *lora])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        grpo.main([*flags, "--steps", "2", "--resume", *([] if saved_with_lora else ["--lora"])])
    assert exit_info.value.code == 2
    line = _one_line(capsys.readouterr().err)
    trained = "a LoRA adapter (--lora)" if saved_with_lora else "every weight (no --lora)"
    assert line.startswith(f"error: --resume: {tmp_path / 'checkpoints' / 'step_000001'} trained {trained}, "), line
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1  # nothing of the refused run was written


def test_resuming_with_other_settings_or_another_algorithm_is_refused_in_one_line(tmp_path, capsys):
    from algos import grpo, red_grpo

    flags = ["--preset", "tiny", "--run-dir", str(tmp_path), "--eval-questions", "0", *DISTRACTOR]
    grpo.main([*flags, "--steps", "1"])
    capsys.readouterr()
    latest = tmp_path / "checkpoints" / "step_000001"
    for main, extra, start in (
        (
            grpo.main,
            ["--lr", "0.5", "--group-size", "3"],
            f"error: --resume: {latest} was trained with other settings ",
        ),
        (red_grpo.main, [], f"error: --resume: {latest} is a checkpoint of grpo, this run is red_grpo: "),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*flags, "--steps", "2", "--resume", *extra])
        assert exit_info.value.code == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(start), line
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1  # nothing of the refused run written
    assert "(--lr 0.001 -> 0.5, --group-size 2 -> 3);" in _one_line(  # in the sections' order
        _refused_run(grpo.main, [*flags, "--steps", "2", "--resume", "--lr", "0.5", "--group-size", "3"], capsys)
    )
    line = _one_line(
        _refused_run(grpo.main, [*flags, "--steps", "2", "--resume", "--lr", "0.5", "--group-size", "3",
                                 "--resume-changed", "lr"], capsys)
    )  # fmt: skip
    assert "(--group-size 2 -> 3); " in line, line
    assert line.endswith("(--resume-changed group-size), or start a new run in another --run-dir"), line
    grpo.main([*flags, "--steps", "2", "--resume", "--lr", "0.5", "--resume-changed", "lr"])  # named: allowed, warned
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def _refused_run(main, argv, capsys) -> str:
    with pytest.raises(SystemExit):
        main(argv)
    return capsys.readouterr().err


# --- the retrieval server's command line ---------------------------------------------------------------------------
def _serve(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "retrievers.server", *argv]
    return subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def busy_port():
    """A port on 127.0.0.1 that another socket listens on."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--corpus", "{tmp}/missing.jsonl"], "error: --corpus: no corpus file at {tmp}/missing.jsonl"),
        (["--corpus", "{tmp}/bad.jsonl"], "error: {tmp}/bad.jsonl: line 2: expected a JSON object (one passage), got"),
        (["--port", "70000"], "error: --port must be in [0, 65535] (0: any free port), got 70000"),
        (["--port", "{busy}"], "error: cannot listen on 127.0.0.1:{busy} (Address already in use); choose"),
        (["--topk", "0"], "error: --topk must be >= 1, got 0"),
        (["--topk", "5", "--max-topk", "3"], "error: --topk (5) must be <= --max-topk (3)"),
        (["--max-hits", "0"], "error: --max-hits must be >= 1, got 0"),
        (["--index", "{tmp}/no-index", "--corpus", "{tmp}/good.jsonl"], "error: --index: no index at {tmp}/no-index"),
    ],
)
def test_the_servers_command_line_errors_are_one_line(argv, message, tmp_path, busy_port):
    (tmp_path / "good.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps(GOOD_ROW) + "\n[1, 2]\n")
    fill = {"tmp": str(tmp_path), "busy": str(busy_port)}
    done = _serve(*(arg.format(**fill) for arg in argv))
    assert done.returncode == 2
    assert _one_line(done.stderr).startswith(message.format(**fill)), done.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("steps: [1\n", "not valid YAML (line 2: expected ',' or ']', but got '<stream end>')"),
        ("steps: abc\n", "steps must be an int, got 'abc'"),
        ("lr: fast\n", "lr must be a number, got 'fast'"),
        ("steps: null\n", "steps must be an int, got None"),
        ("retriever: 5\n", "retriever must be a string, got 5"),
        ("preset: bogus\n", "preset must be one of 'gpu', 'cpu', 'tiny', got 'bogus'"),
        ("group_size: 2.5\n", "group_size must be an int, got 2.5"),
        ("lora_target_modules: q_proj\n", "lora_target_modules must be a list (a string each), got 'q_proj'"),
        ("adam_betas: [0.9]\n", "adam_betas must be a list of 2 (a number each), got [0.9]"),
        ("lora: 1\n", "lora must be true or false, got 1"),
        ("nope: 1\n", "not a setting of Config: nope"),
        ("- 1\n", "a config file is a mapping of field names to values, got list"),
    ],
)
def test_a_config_file_with_a_bad_value_is_refused_in_one_line_naming_the_key(text, message, tmp_path, capsys):
    path = tmp_path / "settings.yaml"
    path.write_text(text)
    assert _refused(["--config", str(path)], capsys) == f"error: --config: {path}: {message}"


def test_a_saved_config_reads_back_as_the_settings_it_was_saved_from(tmp_path):
    from algos.run.cli import load_config_file

    saved = preset_config(
        "cpu",
        lr=5e-5,
        adam_betas=(0.9, 0.95),
        rollout="tree",
        group_size=4,
        tree_branch_turns=(1,),
        eval_data_path=None,
    )
    path = tmp_path / "redcoda_config.json"
    path.write_text(json.dumps(saved.flat()))
    assert saved.with_values(**load_config_file(path)) == saved


def test_a_question_longer_than_the_context_is_refused_naming_the_file_and_its_place(tmp_path, capsys):
    from algos import grpo
    from envs.data import bundled_path
    from retrievers.corpus import open_text

    rows = [json.loads(line) for line, _ in zip(open_text(bundled_path("hotpotqa", "dev")), range(4), strict=False)]
    rows[2]["question"] = "why " * 5000 + "?"
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(["--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--data-path", str(data),
                   "--eval-questions", "0", "--num-questions", "4", *DISTRACTOR])  # fmt: skip
    assert exit_info.value.code == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"error: {data}: question 3 ({rows[2]['_id']}) is 5001 words, more than a context "), line


def test_a_run_dir_that_cannot_be_a_directory_is_refused_in_one_line_naming_it(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert _refused(["--run-dir", str(blocker)], capsys) == f"error: --run-dir '{blocker}' is a file: give a directory"
    under = blocker / "run"
    assert _refused(["--run-dir", str(under)], capsys) == (
        f"error: --run-dir '{under}' is under {blocker}, a file: give a directory"
    )
