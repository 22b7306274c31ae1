"""TRL's GRPOTrainer training a tiny model on our env: our rollout function plays the episodes, our reward
functions score them."""

from __future__ import annotations

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the ids)
from agents.trl_interop import answer_em_reward, answer_f1_reward, env_reward, format_reward, trl_dataset


def test_reward_functions_score_as_the_env_does():
    env = gym.make("RedCoda-HotpotQA-v0", split="dev")
    example = env.unwrapped.examples[3]
    actions = [
        "<think>who?</think><search>" + example.question + "</search>",
        "<refine>" + example.answer + "</refine><answer>" + example.answer + "</answer>",
    ]
    wrong = ["<search>x</search>", "<answer>zzqx</answer>", "no tags at all"]
    env.reset(options={"index": 3})
    for action in actions:
        *_, info = env.step(action)
    (row,) = trl_dataset(env, indices=[3])
    columns = {"golden_answers": [row["golden_answers"]] * 2, "trainer_state": None}
    kwargs = {"prompts": [row["prompt"]] * 2, "completions": ["", ""], "actions": [actions, wrong], **columns}
    assert answer_f1_reward(**kwargs)[0] == info["f1"] == 1.0 and answer_em_reward(**kwargs)[0] == info["em"]
    assert format_reward(**kwargs)[0] == info["format"]
    assert answer_f1_reward(**kwargs)[1] == 0.0 and 0 < format_reward(**kwargs)[1] < info["format"]
    # TRL's own single-turn generation: the completion text is the one turn
    single = {"prompts": [row["prompt"]], "golden_answers": [row["golden_answers"]]}
    assert answer_f1_reward(completions=[actions[1]], **single) == [1.0]
    assert answer_f1_reward(completions=[[{"role": "assistant", "content": actions[1]}]], **single) == [1.0]
    assert env_reward(prompts=[], completions=[], env_reward=[3.1, -3]) == [3.1, -3.0]
    _, first = env.reset(options={"index": 3})
    assert row["prompt"] == first["user_message"] and row["index"] == 3


@pytest.mark.parametrize("env_id", ["RedCoda-HotpotQA-v0", "RedCoda-HotpotQA-CoDA-v0"])
def test_grpo_trainer_steps_on_episodes_of_our_env(env_id, tmp_path, monkeypatch):
    import torch

    trl = pytest.importorskip("trl")

    from agents.models import tiny_model
    from agents.trl_interop import EnvRollout, trained_context

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = tiny_model(max_context=1024)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    limits = {"max_turns": 2} if env_id == "RedCoda-HotpotQA-v0" else {"max_planner_turns": 2, "max_executor_turns": 1}
    rollout = EnvRollout(
        env_id,
        max_new_tokens=12,
        max_context_tokens=1024,
        instructions="short",
        top_k=1,
        max_passage_words=20,
        **limits,
    )
    calls = []

    def low_token_ids(prompts, completions, completion_ids, **kwargs):
        # a tiny random model never answers, so the env's reward ties within each group (zero advantages); this
        # reward on the sampled tokens differs between rollouts and gives the policy loss a gradient
        return [-sum(ids) / len(ids) / len(tokenizer) for ids in completion_ids]

    def recorded_rollout(prompts, trainer):
        out = rollout(prompts, trainer)
        calls.append((list(prompts), out, list(rollout.trajectories)))
        return out

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=str(tmp_path / "model"),
        args=args,
        train_dataset=trl_dataset(rollout.env, indices=range(4)),
        reward_funcs=[env_reward, answer_f1_reward, format_reward, low_token_ids],
        rollout_func=recorded_rollout,
        processing_class=tokenizer,
    )
    trainer.train()

    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach().cpu(), before[n])]
    assert changed, "no parameter changed after two GRPO steps"
    assert len(calls) == 2
    for prompts, out, trajectories in calls:
        assert len(out["completion_ids"]) == len(prompts) == len(trajectories) == 2
        for prompt_ids, ids, mask, logprobs, trajectory in zip(
            out["prompt_ids"], out["completion_ids"], out["env_mask"], out["logprobs"], trajectories, strict=True
        ):
            assert len(ids) == len(mask) == len(logprobs)
            # the episode ran in the env: it ended there, and unless the first action answered, the env's
            # observation sits between two sampled turns (mask 0 inside the completion)
            assert "f1" in trajectory.info and out["env_reward"] == [t.reward for t in trajectories]
            assert len(trajectory.actions) == 1 or 0 in mask
            # the row is the context TRL trains: the flat agent's, or the CoDA planner's
            context = trained_context(trajectory)
            assert context.role == ("agent" if env_id == "RedCoda-HotpotQA-v0" else "planner")
            assert list(context.token_ids[-len(ids) :]) == ids and list(context.loss_mask[-len(ids) :]) == mask
            assert list(context.sample_logprobs[-len(ids) :]) == logprobs and mask[0] == 1
            assert list(context.token_ids) == prompt_ids + ids and 1 not in context.loss_mask[: len(prompt_ids)]
        assert all(len(r) == len(a) for r, a in zip(out["roles"], out["actions"], strict=True))
    logged = [entry for entry in trainer.state.log_history if "rewards/env_reward/mean" in entry]
    assert len(logged) == 2
    for entry, (_, out, _) in zip(logged, calls, strict=True):
        assert entry["rewards/env_reward/mean"] == pytest.approx(sum(out["env_reward"]) / 2, abs=1e-5)


def test_reward_functions_read_a_coda_episode_as_the_env_does():
    """Each action parsed with the role that took it: the planner's <task> is well formed, and an executor's
    <answer> is a sub-answer, never the episode's answer."""
    env = gym.make("RedCoda-HotpotQA-CoDA-v0", split="dev")
    example = env.unwrapped.examples[3]
    actions = [
        "<task>" + example.question + "</task>",
        "<search>" + example.question + "</search>",
        "<answer>" + example.answer + "</answer>",
        "<answer>" + example.answer + "</answer>",
    ]
    env.reset(options={"index": 3})
    roles = []
    for action in actions:
        *_, info = env.step(action)
        roles.append(info["acted_role"])
    assert roles == ["planner", "executor", "executor", "planner"]
    (row,) = trl_dataset(env, indices=[3])
    kwargs = {"prompts": [row["prompt"]], "completions": [""], "golden_answers": [row["golden_answers"]]}
    assert answer_f1_reward(actions=[actions], roles=[roles], **kwargs) == [info["f1"]] == [1.0]
    assert answer_em_reward(actions=[actions], roles=[roles], **kwargs) == [info["em"]]
    assert format_reward(actions=[actions], roles=[roles], **kwargs) == [info["format"]] == [0.75]
    # read as flat-protocol turns, <task> would be malformed; an executor's answer alone answers nothing
    assert format_reward(actions=[actions], **kwargs)[0] < info["format"]
    assert answer_f1_reward(actions=[actions[:3]], roles=[roles[:3]], **kwargs) == [0.0]


class _RecordingVLLMGeneration:
    """Stands in for TRL's `VLLMGeneration` (vLLM is not installed here): records every ``generate`` call and answers
    each with the next scripted text, the same for every row, with log-prob -0.25 per token, in TRL 1.16's layout."""

    max_completion_length = 24
    temperature = 0.7
    top_p = 1.0

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, list(script), []

    def generate(self, prompts, images, num_generations):
        self.calls.append(([list(p) for p in prompts], images, num_generations))
        ids = self.tokenizer(self.script[len(self.calls) - 1], add_special_tokens=False)["input_ids"]
        return [list(p) for p in prompts], [list(ids) for _ in prompts], [[[-0.25]] * len(ids) for _ in prompts], None


def _vllm_trainer(generation, tokenizer, vllm_mode="colocate", processes=1):
    """A trainer as `GRPOTrainer(args=GRPOConfig(use_vllm=True))` shows itself to a rollout function; it has no
    `model`, so a rollout that sampled with transformers would fail."""
    from types import SimpleNamespace

    return SimpleNamespace(
        use_vllm=True,
        vllm_generation=generation,
        processing_class=tokenizer,
        args=SimpleNamespace(vllm_mode=vllm_mode, vllm_tensor_parallel_size=1),
        accelerator=SimpleNamespace(num_processes=processes),
    )


@pytest.mark.parametrize("protocol", ["flat", "coda"])
def test_env_rollout_samples_every_turn_with_the_trainers_vllm_generation(protocol, tiny):
    from agents.trl_interop import EnvRollout

    _, tokenizer = tiny
    env_id = "RedCoda-HotpotQA-v0" if protocol == "flat" else "RedCoda-HotpotQA-CoDA-v0"
    rollout = EnvRollout(env_id, max_context_tokens=4096, instructions="short", top_k=1, max_passage_words=20)
    gold = rollout.env.unwrapped.examples[0].answer
    answer = f"<answer>{gold}</answer>"
    if protocol == "flat":
        script, roles = ["<search>Joe Penny</search> and then", answer], ["agent", "agent"]
    else:
        task = "<think>the show first</think><task>Which show had Jake Styles?</task> more words"
        script = [task, "<search>Jake Styles</search> and then", answer, answer]
        roles = ["planner", "executor", "executor", "planner"]
    generation = _RecordingVLLMGeneration(tokenizer, script)
    (prompt,) = trl_dataset(rollout.env, indices=[0])["prompt"]
    out = rollout([prompt, prompt], _vllm_trainer(generation, tokenizer))

    # one vLLM call per turn for both rows (planner and executor turns alike), nothing from transformers
    assert len(generation.calls) == len(script)
    for rows, images, n in generation.calls:
        assert len(rows) == 2 and images is None and n == 1
    assert out["roles"] == [roles, roles] and out["env_reward"] == [t.reward for t in rollout.trajectories]
    assert [t.info["f1"] for t in rollout.trajectories] == [1.0, 1.0]
    for prompt_ids, ids, mask, logprobs in zip(
        out["prompt_ids"], out["completion_ids"], out["env_mask"], out["logprobs"], strict=True
    ):
        # the trained context opened with the prompt of the first call and grew by each of its role's turns
        assert generation.calls[0][0][0] == prompt_ids
        last_turn = len(mask) - 1 - max(i for i, m in enumerate(mask) if not m)  # tokens after the last insert
        assert generation.calls[-1][0][0] == prompt_ids + ids[: len(ids) - last_turn]
        sampled = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        inserted = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(logprobs, mask, strict=True))
        assert "and then" not in sampled and "more words" not in sampled  # each turn cut after its tool call
        if protocol == "flat":
            assert sampled == "<search>Joe Penny</search>" + answer and "<information>" in inserted
        else:  # the planner's context: its task, the executor's <result>, its answer; no search results
            assert sampled == task.removesuffix(" more words") + answer
            assert f"<result>{gold}</result>" in inserted and "<information>" not in inserted
    assert answer_f1_reward(prompts=[prompt] * 2, completions=["", ""], golden_answers=[[gold]] * 2, **out) == [1, 1]
    if protocol == "coda":  # the executor's context, sampled by vLLM as well, stays outside the row
        for trajectory in rollout.trajectories:
            (executor,) = [g for g in trajectory.generations if g.role == "executor"]
            assert list(executor.token_ids[: len(generation.calls[1][0][0])]) == generation.calls[1][0][0]
            assert "<information>" in tokenizer.decode(executor.token_ids) and -0.25 in executor.sample_logprobs


def test_env_rollout_refuses_a_vllm_layout_whose_generate_is_collective(tiny):
    from agents.trl_interop import EnvRollout

    _, tokenizer = tiny
    rollout = EnvRollout("RedCoda-HotpotQA-CoDA-v0", instructions="short")
    (prompt,) = trl_dataset(rollout.env, indices=[0])["prompt"]
    generation = _RecordingVLLMGeneration(tokenizer, [])
    with pytest.raises(NotImplementedError, match="collective"):
        rollout([prompt], _vllm_trainer(generation, tokenizer, vllm_mode="server", processes=2))
    assert generation.calls == []
