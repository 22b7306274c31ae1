"""Samplers on a tiny real model (random weights, real SmolLM2 tokenizer), and over a real local HTTP server."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import threading
import time

import pytest
import torch

from agents.models import tiny_model
from agents.records import Completion, SamplingParams
from agents.samplers import HFSampler, OpenAISampler, cut_at_stop, encode_chat, overflow

QUESTIONS = ["Who wrote Dune?", "Which river flows through the city that hosted the 1936 Olympics?", "Hi"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sampler(tiny):
    return HFSampler(*tiny)


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tokenizer = tiny
    return [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


def test_hf_sampler_is_a_sampler(sampler, prompts, check_sampler):
    check_sampler(sampler, prompts[0])
    assert sampler.max_context == 512
    assert sampler.tokenizer.pad_token == "<|endoftext|>"


def test_batched_left_padded_greedy_equals_unbatched(sampler, prompts):
    assert len({len(p) for p in prompts}) == len(prompts)  # unequal lengths: left padding is exercised
    batched = sampler.generate(prompts, GREEDY)
    for prompt, completion in zip(prompts, batched, strict=True):
        [alone] = sampler.generate([prompt], GREEDY)
        assert completion.token_ids == alone.token_ids
        assert completion.text == alone.text
        assert completion.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert completion.finish_reason == "length" and len(completion.token_ids) == 16


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_logprobs_match_a_separate_forward_pass(tiny, sampler, prompts, temperature):
    model, _ = tiny
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=3)
    for prompt, completion in zip(prompts, sampler.generate(prompts, params), strict=True):
        ids = torch.tensor([list(prompt) + list(completion.token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # the positions that predicted them
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        expected = logp.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
        assert completion.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_few_row_linears_sample_what_f_linear_samples(tiny, prompts, temperature):
    """Decode steps of <= narrow_rows rows compute W @ x^T: the same tokens and log-probs as `F.linear`."""
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=5)
    narrow, plain = HFSampler(model, tokenizer, narrow_rows=4), HFSampler(model, tokenizer, narrow_rows=0)
    for batch in ([prompts[0]], prompts):  # one row (doubled inside) and three
        got, expected = narrow.generate(batch, params), plain.generate(batch, params)
        for completion, reference in zip(got, expected, strict=True):
            assert completion.token_ids == reference.token_ids
            assert completion.logprobs == pytest.approx(reference.logprobs, abs=1e-5, rel=0)


def test_few_row_linears_are_used_while_sampling_and_undone_afterwards(tiny, prompts, monkeypatch):
    model, tokenizer = tiny
    seen = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append(tuple(b.shape)) or mm(a, b))
    sampler = HFSampler(model, tokenizer, narrow_rows=3)
    sampler.generate(prompts, SamplingParams(max_new_tokens=4, seed=0))
    assert {rows for _, rows in seen} == {3}  # decode steps of 3 rows; the prefills (3 x prompt) use F.linear
    seen.clear()
    sampler.generate(prompts[:1], SamplingParams(max_new_tokens=4, seed=0))
    assert {rows for _, rows in seen} == {2}  # one row, doubled
    assert not any("forward" in vars(m) for m in model.modules())  # every layer has its class's forward again
    seen.clear()
    HFSampler(model, tokenizer, narrow_rows=0).generate(prompts[:1], SamplingParams(max_new_tokens=4, seed=0))
    assert not seen

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(torch, "mm", fail)  # a failing forward: the row is an error, the layers are restored
    [completion] = HFSampler(model, tokenizer, narrow_rows=4).generate(prompts[:1], GREEDY)
    assert completion.finish_reason == "error" and "boom" in completion.error
    assert not any("forward" in vars(m) for m in model.modules())
    with pytest.raises(ValueError, match="narrow_rows must be >= 0"):
        HFSampler(model, tokenizer, narrow_rows=-1)


def test_a_call_of_short_and_long_prompts_runs_as_two_batches_on_a_cpu(tiny, monkeypatch):
    """Four short prompts and two of 300 tokens: one batch would pad the four to 300 (1,800 prefill tokens for
    642), so the CPU default runs the short ones and the long ones apart; greedy samples the same. A call of 8
    rows or more prefills in groups of like length instead, so it stays one batch: one loop of decode steps."""
    from agents.samplers import hf

    model, tokenizer = tiny
    short = [[100 + i] * (10 + i % 3) for i in range(6)]
    long = [[200 + i] * (300 - i) for i in range(2)]
    prompts = [long[0], *short[:2], long[1], *short[2:4]]  # the call's order is kept in what it returns
    seen: list[list[int]] = []
    decode = HFSampler._decode
    monkeypatch.setattr(
        HFSampler, "_decode", lambda self, rows, p: seen.append([i for i, *_ in rows]) or decode(self, rows, p)
    )
    split = HFSampler(model, tokenizer, cache_tokens=0)
    assert split.pad_limit == 2.0  # the default on a CPU
    got = split.generate(prompts, GREEDY)
    assert [sorted(batch) for batch in seen] == [[1, 2, 4, 5], [0, 3]]
    seen.clear()
    expected = HFSampler(model, tokenizer, cache_tokens=0, pad_limit=0).generate(prompts, GREEDY)
    assert [sorted(batch) for batch in seen] == [list(range(6))]  # no limit: one batch, as many as fit
    for completion, reference in zip(got, expected, strict=True):
        assert completion.token_ids == reference.token_ids
        assert completion.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    seen.clear()
    groups: list[int] = []
    apart = hf.prefill_apart
    monkeypatch.setattr(hf, "prefill_apart", lambda m, parts, *a: groups.append(len(parts)) or apart(m, parts, *a))
    split.generate([long[0], *short[:3], long[1], *short[3:]], GREEDY)
    assert [sorted(batch) for batch in seen] == [list(range(8))] and groups == [2]  # one batch, two prefills
    seen.clear()
    HFSampler(model, tokenizer, cache_tokens=0, max_batch_size=4).generate(short + long, GREEDY)
    assert [len(batch) for batch in seen] == [4, 4]  # max_batch_size bounds each batch (else 6 and 2)
    for bad in (-1, 0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="pad_limit must be 0"):
            HFSampler(model, tokenizer, pad_limit=bad)


def test_sampled_tokens_follow_the_tempered_nucleus_distribution(sampler):
    """Frequencies over 40,000 rows match the probabilities; top-p never leaves the nucleus; NaN is an error."""
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(0)) * 2
    rows = logits.expand(40_000, -1)
    for params in (SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=0.5, top_p=0.8, seed=0)):
        sampler._generator.manual_seed(0)
        tokens, logps = sampler._sample(rows, params)
        probs = torch.softmax(logits[0] / params.temperature, dim=-1).double()
        if params.top_p < 1:
            order = probs.argsort(descending=True)
            nucleus = order[: int((probs[order].cumsum(0) - probs[order] < params.top_p).sum())]
            probs = torch.zeros_like(probs).index_fill(0, nucleus, 1.0) * probs
            probs /= probs.sum()
            assert set(tokens.tolist()) <= set(nucleus.tolist())
        freq = torch.bincount(tokens, minlength=40).double() / len(tokens)
        sigma = (probs * (1 - probs) / len(tokens)).sqrt()
        assert ((freq - probs).abs() <= 5 * sigma + 1e-4).all()
        assert logps.double().exp().tolist() == pytest.approx(probs[tokens].tolist(), rel=1e-4)
    with pytest.raises(ValueError, match="non-finite"):
        sampler._sample(torch.full((2, 40), float("nan")), SamplingParams(temperature=1.0))


def test_top_p_logprobs_are_renormalised_over_the_nucleus(tiny, sampler, prompts):
    model, _ = tiny
    [completion] = sampler.generate(prompts[:1], SamplingParams(max_new_tokens=8, top_p=0.5, seed=1))
    ids = torch.tensor([list(prompts[0]) + list(completion.token_ids)])
    with torch.no_grad():
        full = torch.log_softmax(model(ids).logits[0, len(prompts[0]) - 1 : -1].float(), dim=-1)
    model_logp = full.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
    assert all(s >= m - 1e-5 for s, m in zip(completion.logprobs, model_logp.tolist(), strict=True))
    assert all(s <= 1e-6 for s in completion.logprobs)


def test_stop_strings_stop_each_row_and_drop_later_tokens(sampler, prompts):
    tokenizer = sampler.tokenizer
    full = sampler.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0))
    stops = tuple(tokenizer.decode(c.token_ids[5 + 3 * r : 7 + 3 * r]) for r, c in enumerate(full))
    assert all(stops)
    stopped = sampler.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0, stop=stops))
    for whole, completion in zip(full, stopped, strict=True):
        # the shortest prefix of the unstopped greedy reply whose text holds a stop string
        k = next(k for k in range(1, 25) if cut_at_stop(tokenizer.decode(whole.token_ids[:k]), stops)[1])
        assert completion.finish_reason == "stop"
        assert completion.token_ids == whole.token_ids[:k]
        assert completion.logprobs == pytest.approx(whole.logprobs[:k], abs=1e-4)
        assert completion.text == cut_at_stop(tokenizer.decode(whole.token_ids[:k]), stops)[0]
        assert any(completion.text.endswith(s) for s in stops)


def test_end_of_turn_token_ends_a_row_with_an_empty_text(tiny, prompts):
    model, tokenizer = tiny
    first = HFSampler(model, tokenizer).generate(prompts[:1], GREEDY)[0].token_ids[0]
    eos_first = HFSampler(model, tokenizer, stop_token_ids=[first, tokenizer.eos_token_id])
    [completion] = eos_first.generate(prompts[:1], GREEDY)
    assert completion == Completion("", (first,), completion.logprobs, "stop")
    [nothing] = eos_first.generate(prompts[:1], SamplingParams(max_new_tokens=0))
    assert nothing == Completion("", (), (), "length")


def test_seeds_reproduce_samples(sampler, prompts):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
    first = sampler.generate(prompts, params)
    again = sampler.generate(prompts, params)  # the same tokens; log-probs within float rounding (a kept prefix's)
    assert [(c.text, c.token_ids, c.finish_reason) for c in again] == [
        (c.text, c.token_ids, c.finish_reason) for c in first
    ]
    for a, b in zip(again, first, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    other = sampler.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, seed=8))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_overlong_prompt_is_left_truncated_and_reported(tiny, prompts, caplog):
    model, tokenizer = tiny
    short = HFSampler(model, tokenizer, max_context=40)
    long_prompt = encode_chat(tokenizer, [{"role": "user", "content": "tell me more " * 12}])
    drop = overflow(len(long_prompt), 8, short.max_context)
    assert drop == len(long_prompt) - 32 > 0
    with caplog.at_level(logging.WARNING, logger="agents.samplers.hf"):
        truncated, fits = short.generate([long_prompt, prompts[2]], SamplingParams(max_new_tokens=8, temperature=0))
    assert f"prompt 0: dropped its first {drop} tokens to fit 40" in caplog.text
    [expected] = short.generate([long_prompt[drop:]], SamplingParams(max_new_tokens=8, temperature=0))
    assert truncated.token_ids == expected.token_ids and len(truncated.token_ids) == 8
    assert truncated.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert fits.finish_reason == "length" and fits.error is None


def test_overflow_keeps_at_least_one_prompt_token():
    assert overflow(10, 5, 100) == 0
    assert overflow(100, 10, 100) == 10
    assert overflow(100, 500, 100) == 99


def test_bad_rows_become_errors_and_the_batch_survives(sampler, prompts):
    out = sampler.generate([prompts[0], [], [10**9, 5], prompts[1], ["x"]], GREEDY)
    assert [c.finish_reason for c in out] == ["length", "error", "error", "length", "error"]
    assert "empty prompt" in out[1].error and "outside the vocabulary" in out[2].error
    assert out[0].token_ids == sampler.generate(prompts[:1], GREEDY)[0].token_ids


def test_garbage_completions_decode_without_crashing(sampler):
    random_prompt = torch.randint(0, len(sampler.tokenizer), (30,), generator=torch.Generator().manual_seed(0))
    out = sampler.generate([random_prompt.tolist()] * 4, SamplingParams(max_new_tokens=24, temperature=8.0, seed=0))
    for completion in out:
        assert completion.finish_reason in ("length", "stop") and isinstance(completion.text, str)
        assert completion.text == sampler.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert all(math.isfinite(lp) for lp in completion.logprobs)
    lone_byte = sampler.tokenizer.convert_tokens_to_ids("Ã")  # half of a two-byte UTF-8 character
    assert "\ufffd" in sampler.tokenizer.decode([lone_byte])


def test_chat_template_renders_roles():
    _, tokenizer = tiny_model()
    ids = encode_chat(tokenizer, [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert (
        tokenizer.decode(ids)
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_import_agents_does_not_import_torch():
    code = "import sys, agents, agents.records, agents.samplers; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vllm_sampler_without_vllm_says_how_to_install():
    pytest.importorskip("agents.samplers.vllm_engine")
    try:
        import vllm  # noqa: F401
    except ImportError:
        from agents.samplers import VLLMSampler

        with pytest.raises(ImportError, match="pip install"):
            VLLMSampler()
    else:
        pytest.skip("vllm is installed")


# --- OpenAI-compatible endpoint: a real HTTP server on 127.0.0.1 that serves the tiny model -----------------


@pytest.fixture(scope="module")
def server_url(tiny):
    fastapi = pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    model, tokenizer = tiny
    backend = HFSampler(model, tokenizer)
    lock = threading.Lock()
    app = fastapi.FastAPI()

    @app.post("/v1/completions")
    def completions(body: dict) -> dict:
        if body.get("model") != "tiny":
            raise fastapi.HTTPException(404, f"no model {body.get('model')!r}")
        ids = tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
        params = SamplingParams(
            max_new_tokens=body["max_tokens"],
            temperature=body["temperature"],
            top_p=body["top_p"],
            stop=tuple(body.get("stop") or ()),
            seed=body.get("seed"),
        )
        with lock:
            [c] = backend.generate([ids], params)
        # As vLLM: the text loses the stop string, stop_reason names it, log-probs cover every sampled token.
        text, matched = c.text, None
        for s in params.stop:
            if c.finish_reason == "stop" and text.endswith(s):
                text, matched = text[: -len(s)], s
        as_ids = body.get("return_tokens_as_token_ids")
        tokens = [f"token_id:{t}" if as_ids else tokenizer.decode([t]) for t in c.token_ids]
        choice = {
            "index": 0,
            "text": text,
            "finish_reason": c.finish_reason,
            "logprobs": {"tokens": tokens, "token_logprobs": list(c.logprobs)},
        }
        if as_ids:
            choice["stop_reason"] = matched
        return {"id": "cmpl-0", "object": "text_completion", "model": "tiny", "choices": [choice]}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)


def test_openai_sampler_matches_the_model_it_serves(tiny, sampler, prompts, server_url, check_sampler):
    _, tokenizer = tiny
    client = OpenAISampler(server_url, "tiny", tokenizer, extra_body={"return_tokens_as_token_ids": True})
    check_sampler(client, prompts[0])
    full = sampler.generate(prompts[:1], GREEDY)[0]
    stop = (tokenizer.decode(full.token_ids[6:8]),)
    params = SamplingParams(max_new_tokens=16, temperature=0, stop=stop)
    remote = client.generate(prompts, params)
    for prompt, got in zip(prompts, remote, strict=True):
        [local] = sampler.generate([prompt], params)
        assert got.text == local.text and got.token_ids == local.token_ids
        assert got.logprobs == pytest.approx(local.logprobs, abs=1e-5)
        assert got.finish_reason == local.finish_reason
    assert remote[0].finish_reason == "stop" and remote[0].text.endswith(stop[0])
    client.close()


def test_openai_sampler_retokenizes_plain_text_replies(tiny, sampler, prompts, server_url):
    _, tokenizer = tiny
    client = OpenAISampler(server_url, "tiny", tokenizer)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    for prompt, got in zip(prompts, client.generate(prompts, params), strict=True):
        [local] = sampler.generate([prompt], params)
        assert got.text == local.text
        assert got.token_ids == tuple(tokenizer(local.text, add_special_tokens=False)["input_ids"])
        assert len(got.logprobs) == len(got.token_ids)
    client.close()


def test_openai_sampler_failures_are_per_row_errors(tiny, prompts, server_url):
    _, tokenizer = tiny
    wrong_model = OpenAISampler(server_url, "missing", tokenizer, max_retries=0)
    [bad] = wrong_model.generate(prompts[:1], GREEDY)
    assert bad.finish_reason == "error" and "404" in bad.error
    dead = OpenAISampler("http://127.0.0.1:9/v1", "tiny", tokenizer, max_retries=1, timeout_s=2)
    out = dead.generate([prompts[0], []], GREEDY)
    assert [c.finish_reason for c in out] == ["error", "error"]
    assert "ConnectError" in out[0].error and "empty prompt" in out[1].error


def test_closing_tags_are_restored_when_the_server_drops_them():
    from agents.samplers.openai_api import _restore_stop

    stops = ("</search>", "</answer>")
    assert _restore_stop("<think>x</think><search>q", stops, ...) == "<think>x</think><search>q</search>"
    assert _restore_stop("<search>a</search><answer>b", stops, ...) == "<search>a</search><answer>b</answer>"
    assert _restore_stop("done", stops, ...) == "done"
    assert _restore_stop("<answer>b", stops, None) == "<answer>b"  # vLLM: ended on a token
    assert _restore_stop("<answer>b", stops, "</answer>") == "<answer>b</answer>"


def test_evaluate_scores_a_served_model_as_it_scores_the_model_itself(tiny, server_url, tmp_path):
    """`evaluate(sampler="openai")` (`benchmarks.evaluate --sampler openai`): a served model's episodes in the real
    env, greedy, start with the same replies as the same model sampled in process."""
    from agents.evaluation import evaluate

    model, tokenizer = tiny
    tokenizer.save_pretrained(tmp_path)  # the served model's tokenizer, read from the directory --model names
    common = dict(limit=2, batch=2, max_new_tokens=12, max_context_tokens=512, progress=False)
    common["env_kwargs"] = {"corpus": "distractor"}
    served = evaluate(
        "search_r1", str(tmp_path), sampler="openai", sampler_url=server_url, served_model="tiny", **common
    )
    local = evaluate("search_r1", (model, tokenizer), **common)
    assert served["n"] == 2
    for a, b in zip(served["predictions"], local["predictions"], strict=True):
        # the first reply of each episode; later turns differ where the served text re-tokenizes other ids
        assert a["actions"][0] == b["actions"][0] and a["index"] == b["index"]
