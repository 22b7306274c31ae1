"""Our env and rewards inside TRL's `GRPOTrainer`: reward functions and a multi-turn rollout function.

TRL calls a reward function as ``reward_func(prompts=..., completions=..., completion_ids=..., **columns)``, where
the keyword arguments carry the dataset's columns, whatever the rollout function returned besides its token
fields, and ``trainer_state``, ``log_extra``, ``log_metric``; it wants one float (or None) per completion. The
functions here score with `envs.rewards` (the official HotpotQA F1 and EM, the graduated format score), so a
TRL run and our trainers compute the same numbers.

`EnvRollout` is a `rollout_func` (an experimental `GRPOTrainer` argument): RAGEnv episodes with the trainer's model.

    from trl import GRPOConfig, GRPOTrainer
    from agents.trl_interop import EnvRollout, answer_f1_reward, env_reward, format_reward, trl_dataset

    rollout = EnvRollout("RedCoda-HotpotQA-v0", max_new_tokens=128)
    trainer = GRPOTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        args=GRPOConfig(output_dir="out", num_generations=4),
        train_dataset=trl_dataset(rollout.env),
        reward_funcs=[env_reward],  # or [answer_f1_reward, format_reward] with reward_weights
        rollout_func=rollout,
    )
    trainer.train()

Only the flat protocol fits TRL's one-completion-per-prompt layout (a CoDA episode has several contexts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym

import envs  # noqa: F401  (registers the RedCoda-* ids)
from agents.records import SamplingParams, Trajectory
from agents.search_agents import SearchR1Agent
from envs.protocol import parse_action, user_message
from envs.rewards import exact_match, f1_score, format_score

__all__ = ["EnvRollout", "answer_em_reward", "answer_f1_reward", "env_reward", "format_reward", "trl_dataset"]


def _text(completion: str | list[dict[str, Any]]) -> str:
    """A completion's text: TRL passes a string for plain prompts and a list of messages for chat prompts."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)


def _turns(completions: Sequence[Any], actions: Sequence[Sequence[str]] | None) -> list[list[str]]:
    """The model's turns of each completion: the episode's actions where a rollout recorded them, else the
    whole completion as one turn (TRL's own single-turn generation)."""
    if actions is not None:
        return [list(turns) for turns in actions]
    return [[_text(completion)] for completion in completions]


def _final_answer(turns: Sequence[str]) -> str | None:
    """The answer of the last turn that is a valid <answer> call, as the env reads it; None if none is."""
    for turn in reversed(turns):
        parsed = parse_action(turn)
        if parsed.tool == "answer":
            return parsed.argument
    return None


def answer_f1_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    golden_answers: Sequence[Sequence[str]],
    actions: Sequence[Sequence[str]] | None = None,
    **kwargs: Any,
) -> list[float]:
    """F1 of each completion's <answer> against the gold answers (official HotpotQA F1; 0 without an answer).

    Args:
        prompts: the prompts (unused; part of TRL's signature).
        completions: the completions, strings or message lists.
        golden_answers: the dataset column of gold answers (a list per row; `trl_dataset` writes it).
        actions: each episode's action texts, where `EnvRollout` produced the completions.
        **kwargs: the other columns and TRL's own arguments (ignored).
    """
    answers = [_final_answer(turns) for turns in _turns(completions, actions)]
    return [0.0 if a is None else f1_score(a, golds) for a, golds in zip(answers, golden_answers, strict=True)]


def answer_em_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    golden_answers: Sequence[Sequence[str]],
    actions: Sequence[Sequence[str]] | None = None,
    **kwargs: Any,
) -> list[float]:
    """Exact match of each completion's <answer> with a gold answer (official HotpotQA EM; 0 without an answer).

    Args are those of `answer_f1_reward`.
    """
    answers = [_final_answer(turns) for turns in _turns(completions, actions)]
    return [0.0 if a is None else exact_match(a, golds) for a, golds in zip(answers, golden_answers, strict=True)]


def format_reward(
    prompts: Sequence[Any], completions: Sequence[Any], actions: Sequence[Sequence[str]] | None = None, **kwargs: Any
) -> list[float]:
    """The env's graduated format score of each completion: 0.25 per protocol tag used and never malformed.

    Args:
        prompts: the prompts (unused).
        completions: the completions, strings or message lists.
        actions: each episode's action texts, where `EnvRollout` produced the completions (the score then
            covers every turn, as the env's does).
        **kwargs: the other columns and TRL's own arguments (ignored).
    """
    scores = []
    for turns in _turns(completions, actions):
        parsed = [parse_action(turn) for turn in turns]
        used = set().union(*(p.used_tags for p in parsed))
        malformed = set().union(*(p.malformed_tags for p in parsed))
        scores.append(format_score(used, malformed))
    return scores


def env_reward(
    prompts: Sequence[Any], completions: Sequence[Any], env_reward: Sequence[float], **kwargs: Any
) -> list[float]:
    """The env's own terminal reward of each episode (``6*F1 - 3 + 0.1*format + 0.1*refine``), as `EnvRollout`
    forwarded it.

    Args:
        prompts: the prompts (unused).
        completions: the completions (unused).
        env_reward: the episode rewards, one per completion.
        **kwargs: the other columns and TRL's own arguments (ignored).
    """
    return [float(r) for r in env_reward]


def _first_user_messages(env: gym.Env) -> list[str]:
    """The user message that opens each question's episode (what `reset` puts in ``info["user_message"]``)."""
    base = env.unwrapped
    return [user_message(base.first_role, example.question) for example in base.examples]


def trl_dataset(env: gym.Env, indices: Sequence[int] | None = None) -> Any:
    """A `datasets.Dataset` of the env's questions for `GRPOTrainer`: ``prompt`` (the episode's first user message,
    by which `EnvRollout` finds the question), ``index`` and ``golden_answers``.

    Args:
        env: a RAGEnv (wrapped or not).
        indices: which questions (default: all).
    """
    from datasets import Dataset

    examples, messages = env.unwrapped.examples, _first_user_messages(env)
    chosen = [int(i) for i in (range(len(examples)) if indices is None else indices)]
    return Dataset.from_dict(
        {
            "prompt": [messages[i] for i in chosen],
            "index": chosen,
            "golden_answers": [list(examples[i].answers) for i in chosen],
        }
    )


class EnvRollout:
    """A TRL `rollout_func` that plays each prompt's question as one RAGEnv episode with the trainer's model.

    TRL hands a rollout function the per-process list of prompts (each already repeated `num_generations` times) and
    the trainer; it plays one episode of RAGEnv per prompt with the trainer's own model (`SearchR1Agent` over an
    `HFSampler`: real searches through the env's retriever) and returns, per episode, ``prompt_ids`` (the
    chat-template prompt), ``completion_ids`` (every later token of the episode's one growing context: the model's
    turns and the env's observations), ``logprobs`` (sampling log-probs, 0 on observation tokens), ``env_mask`` (1
    on sampled tokens, 0 on observations: TRL masks the loss with it) and the extra fields ``env_reward``,
    ``actions`` and ``num_searches`` that TRL forwards to the reward functions.

    Args:
        env_id: registered id of a flat-protocol env.
        max_new_tokens: tokens sampled per turn (a turn also stops after its tool call's closing tag).
        temperature: sampling temperature.
        max_context_tokens: an episode whose context would grow past this ends as unanswered.
        **env_kwargs: arguments of `gym.make(env_id, ...)` (retriever, top_k, max_turns, ...); every episode's env
            shares one retriever.
    """

    def __init__(
        self,
        env_id: str = "RedCoda-HotpotQA-v0",
        *,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        max_context_tokens: int = 4096,
        **env_kwargs: Any,
    ) -> None:
        self.env_id, self.env_kwargs = env_id, env_kwargs
        self.env = gym.make(env_id, **env_kwargs)
        if self.env.unwrapped.protocol != "flat":
            raise ValueError(f"EnvRollout plays the flat protocol; {env_id} uses {self.env.unwrapped.protocol!r}")
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
        self.max_context_tokens = max_context_tokens
        self._envs: list[gym.Env] = [self.env]
        self._index: dict[str, int] = {}
        self.trajectories: list[Trajectory] = []
        """The episodes of the last call, in prompt order."""

    def _question_index(self, prompt: Any) -> int:
        text = _text(prompt if isinstance(prompt, str) else [m for m in prompt if m.get("role") == "user"])
        if not self._index:
            for i, message in enumerate(_first_user_messages(self.env)):
                self._index.setdefault(message, i)
        if text not in self._index:
            raise KeyError(
                f"prompt is none of {self.env_id}'s questions (build the dataset with trl_dataset): {text[:80]!r}"
            )
        return self._index[text]

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        """Play one episode per prompt; return TRL's token fields plus the extra fields for reward functions."""
        from agents.samplers.hf import HFSampler

        indices = [self._question_index(p) for p in prompts]
        while len(self._envs) < len(prompts):
            self._envs.append(gym.make(self.env_id, **self.env_kwargs))
        model = trainer.accelerator.unwrap_model(trainer.model)
        # no cache between calls: the weights change after every optimizer step
        sampler = HFSampler(model, trainer.processing_class, cache_tokens=0)
        agent = SearchR1Agent(sampler, self.params, max_context_tokens=self.max_context_tokens)
        self.trajectories = agent.rollout(self._envs[: len(prompts)], indices)
        out: dict[str, list] = {
            "prompt_ids": [],
            "completion_ids": [],
            "logprobs": [],
            "env_mask": [],
            "env_reward": [],
            "actions": [],
            "num_searches": [],
        }
        for trajectory in self.trajectories:
            (context,) = trajectory.generations  # flat protocol: one growing context per episode
            start = context.loss_mask.index(1) if 1 in context.loss_mask else len(context.token_ids)
            out["prompt_ids"].append(list(context.token_ids[:start]))
            out["completion_ids"].append(list(context.token_ids[start:]))
            out["logprobs"].append(list(context.sample_logprobs[start:]))
            out["env_mask"].append(list(context.loss_mask[start:]))
            out["env_reward"].append(float(trajectory.reward))
            out["actions"].append(list(trajectory.actions))
            out["num_searches"].append(int(trajectory.info.get("num_searches", 0)))
        return out
