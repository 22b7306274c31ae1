"""TRL's environment mode on our env: `RedCodaToolEnv`'s tools play RAGEnv episodes and its reward is the env's,
and `GRPOTrainer(environment_factory=...)` trains a tiny model two steps through them."""

from __future__ import annotations

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the ids)
from agents.trl_env import OVER, RedCodaToolEnv, environment_factory, tool_dataset

QUERY = "Scott Derrickson"
"""The search the tiny model is taught to call (a title of the bundled corpus)."""


def test_tool_calls_play_the_env_and_its_reward_is_the_env_s():
    make = environment_factory("RedCoda-HotpotQA-v0", max_turns=3)
    answered, silent = make(), make()
    assert answered.env.unwrapped.retriever is silent.env.unwrapped.retriever  # one index for every rollout
    answered.reset(index=3, prompt="(TRL passes the whole row)")
    assert '<information>Doc 1 (Title: "Qazi Touqeer")' in answered.search("Qazi Touqeer")
    assert "recorded" in answered.answer("Kolkata") and answered.search("more") == OVER

    plain = gym.make("RedCoda-HotpotQA-v0", max_turns=3)
    plain.reset(options={"index": 3})
    plain.step("<search>Qazi Touqeer</search>")
    _, reward, terminated, _, info = plain.step("<answer>Kolkata</answer>")
    assert terminated and answered.get_reward() == reward and answered.info["f1"] == info["f1"] == 1.0

    silent.reset(index=3)  # the model stopped without answering: scored as unanswered, as the env scores it
    assert silent.get_reward() == -3.0 and silent.info["answered"] is False

    silent.reset(index=3)  # the turn limit ends the episode; later calls are told so
    for _ in range(3):
        reply = silent.search("Qazi Touqeer")
    assert reply.endswith(OVER) and silent.info["num_searches"] == 3 and silent.get_reward() < 0


def test_the_coda_protocol_is_refused_with_what_to_use_instead():
    with pytest.raises(ValueError, match="EnvRollout"):
        RedCodaToolEnv(gym.make("RedCoda-HotpotQA-CoDA-v0"))


def _teach_the_search_call(model, tokenizer, prompts, tools, steps=60):
    """A few SFT steps on the assistant turn that calls ``search`` (as the chat template writes it), so that the
    tiny random model calls the tool at all; returns the last step's loss."""
    import torch

    call = {"type": "function", "function": {"name": "search", "arguments": {"query": QUERY}}}
    rows = []
    for messages in prompts:
        start = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=tools, tokenize=False
        )
        prompt_ids = tokenizer(start, add_special_tokens=False)["input_ids"]
        ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
        rows.append((torch.tensor([ids]), torch.tensor(ids[len(prompt_ids) :])))
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(steps):
        ids, target = rows[step % len(rows)]
        # logits of the turn's positions only: the prompt (the tools' schema) is long and needs none
        logits = model(input_ids=ids, logits_to_keep=len(target) + 1).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.detach())


def test_grpo_trainer_trains_two_steps_in_environment_mode(tmp_path, monkeypatch):
    import torch

    trl = pytest.importorskip("trl")
    from trl.chat_template_utils import qwen2_5_chat_template

    from agents.models import tiny_model

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    make_env = environment_factory("RedCoda-HotpotQA-v0", max_turns=3, top_k=1, max_passage_words=20)
    dataset = tool_dataset(make_env().env, indices=range(4))
    model, tokenizer = tiny_model(max_context=2048)
    tokenizer.chat_template = qwen2_5_chat_template  # a tool-calling template whose calls TRL parses
    probe = RedCodaToolEnv(gym.make("RedCoda-HotpotQA-v0"))
    tools = [probe.answer, probe.search]  # in TRL's order: the env's methods by name
    assert _teach_the_search_call(model, tokenizer, dataset["prompt"], tools) < 0.1
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    def low_token_ids(prompts, completions, completion_ids, **kwargs):
        # every rollout makes the same taught call, so the env's reward ties within each group (zero advantages);
        # this reward on the sampled tokens differs between rollouts and gives the policy loss a gradient
        return [-sum(ids) / len(ids) / len(tokenizer) for ids in completion_ids]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_steps=2,
        max_completion_length=96,
        max_tool_calling_iterations=2,
        learning_rate=1e-3,  # small enough that the taught call survives the first update
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=str(tmp_path / "model"),
        args=args,
        train_dataset=dataset,
        reward_funcs=[low_token_ids],
        environment_factory=make_env,
        processing_class=tokenizer,
    )
    trainer.train()

    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach().cpu(), before[n])]
    assert changed, "no parameter changed after two GRPO steps"
    rollouts = trainer._environment_pool[None]
    assert len(rollouts) == 2 and all(r.info is not None for r in rollouts)  # each episode ended in the env
    assert sum(r.info["num_searches"] for r in rollouts) >= 1  # the model's tool calls reached the env
    assert all(entry["tools/call_frequency"] > 0 for entry in trainer.state.log_history if "loss" in entry)
    logged = [entry for entry in trainer.state.log_history if "rewards/RedCodaToolEnv/mean" in entry]
    assert len(logged) == 2  # the env's own reward, logged under its class name, every step
    assert logged[-1]["rewards/RedCodaToolEnv/mean"] == pytest.approx(sum(r.get_reward() for r in rollouts) / 2)
