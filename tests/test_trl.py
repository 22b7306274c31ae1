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


def test_grpo_trainer_steps_on_episodes_of_our_env(tmp_path, monkeypatch):
    import torch

    trl = pytest.importorskip("trl")

    from agents.models import tiny_model
    from agents.trl_interop import EnvRollout

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tokenizer = tiny_model(max_context=1024)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    rollout = EnvRollout(
        max_new_tokens=12, max_context_tokens=1024, instructions="short", max_turns=2, top_k=1, max_passage_words=20
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
        for ids, mask, logprobs, trajectory in zip(
            out["completion_ids"], out["env_mask"], out["logprobs"], trajectories, strict=True
        ):
            assert len(ids) == len(mask) == len(logprobs)
            # the episode ran in the env: it ended there, and unless the first action answered, the env's
            # observation sits between two sampled turns (mask 0 inside the completion)
            assert "f1" in trajectory.info and out["env_reward"] == [t.reward for t in trajectories]
            assert len(trajectory.actions) == 1 or 0 in mask
    logged = [entry for entry in trainer.state.log_history if "rewards/env_reward/mean" in entry]
    assert len(logged) == 2
    for entry, (_, out, _) in zip(logged, calls, strict=True):
        assert entry["rewards/env_reward/mean"] == pytest.approx(sum(out["env_reward"]) / 2, abs=1e-5)
