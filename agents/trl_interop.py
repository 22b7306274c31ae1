"""Our env and rewards inside TRL's `GRPOTrainer`: reward functions and a multi-turn rollout function.

TRL calls a reward function as ``reward_func(prompts=..., completions=..., completion_ids=..., **columns)``, the
keyword arguments carrying the dataset's columns, the rollout function's extra fields and TRL's own arguments; it
wants one float (or None) per completion. The functions here score with `envs.rewards` (official HotpotQA F1 and EM,
the graduated format score), so a TRL run and our trainers compute the same numbers.

`EnvRollout` is a `rollout_func` (an experimental `GRPOTrainer` argument): RAGEnv episodes of either protocol with
the trainer's model, sampled by the trainer's vLLM generation under ``use_vllm=True``. A flat episode is its one
context; a CoDA episode's row is the planner's context, and the executors act but TRL does not train them (see
`EnvRollout` for why and for what each row holds).

    from trl import GRPOConfig, GRPOTrainer
    from agents.trl_interop import EnvRollout, answer_f1_reward, env_reward, format_reward, trl_dataset

    rollout = EnvRollout("RedCoda-HotpotQA-v0", max_new_tokens=128)  # or "RedCoda-HotpotQA-CoDA-v0"
    trainer = GRPOTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        args=GRPOConfig(output_dir="out", num_generations=4),  # use_vllm=True: vLLM samples every turn
        train_dataset=trl_dataset(rollout.env),
        reward_funcs=[env_reward],  # or [answer_f1_reward, format_reward] with reward_weights
        rollout_func=rollout,
    )
    trainer.train()
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import gymnasium as gym

import envs  # noqa: F401  (registers the RedCoda-* ids)
from agents.records import Completion, Generation, SamplingParams, Trajectory
from agents.samplers import Sampler, TokenizerContext, cut_at_stop, overflow
from agents.search_agents import CodaAgent, SearchR1Agent
from envs.protocol import parse_action, user_message
from envs.rewards import exact_match, f1_score, format_score

__all__ = [
    "EnvRollout",
    "TRLVLLMSampler",
    "answer_em_reward",
    "answer_f1_reward",
    "env_reward",
    "format_reward",
    "trained_context",
    "trl_dataset",
]


def _text(completion: str | list[dict[str, Any]]) -> str:
    """A completion's text: TRL passes a string for plain prompts and a list of messages for chat prompts."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content", "")) for message in completion)


def _turns(
    completions: Sequence[Any], actions: Sequence[Sequence[str]] | None, roles: Sequence[Sequence[str]] | None
) -> list[list[tuple[str, str]]]:
    """The model's turns of each completion as (role, text): the episode's actions and the role that took each where
    a rollout recorded them (the flat agent's role where it recorded no roles), else the whole completion as one
    flat-protocol turn (TRL's own single-turn generation)."""
    if actions is None:
        return [[("agent", _text(completion))] for completion in completions]
    if roles is None:
        return [[("agent", turn) for turn in turns] for turns in actions]
    return [list(zip(turn_roles, turns, strict=True)) for turns, turn_roles in zip(actions, roles, strict=True)]


def _final_answer(turns: Sequence[tuple[str, str]]) -> str | None:
    """The episode's answer as the env reads it: the last valid <answer> of the agent or the planner (an executor's
    <answer> is a sub-answer that goes back to the planner); None if there is none."""
    for role, turn in reversed(turns):
        parsed = parse_action(turn, role)
        if role != "executor" and parsed.tool == "answer":
            return parsed.argument
    return None


def answer_f1_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    golden_answers: Sequence[Sequence[str]],
    actions: Sequence[Sequence[str]] | None = None,
    roles: Sequence[Sequence[str]] | None = None,
    **kwargs: Any,
) -> list[float]:
    """F1 of each completion's <answer> against the gold answers (official HotpotQA F1; 0 without an answer).

    Args:
        prompts: the prompts (unused; part of TRL's signature).
        completions: the completions, strings or message lists.
        golden_answers: the dataset column of gold answers (a list per row; `trl_dataset` writes it).
        actions: each episode's action texts, where `EnvRollout` produced the completions.
        roles: the role that took each action ("agent", or CoDA's "planner" and "executor"), where `EnvRollout`
            produced the completions.
        **kwargs: the other columns and TRL's own arguments (ignored).
    """
    answers = [_final_answer(turns) for turns in _turns(completions, actions, roles)]
    return [0.0 if a is None else f1_score(a, golds) for a, golds in zip(answers, golden_answers, strict=True)]


def answer_em_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    golden_answers: Sequence[Sequence[str]],
    actions: Sequence[Sequence[str]] | None = None,
    roles: Sequence[Sequence[str]] | None = None,
    **kwargs: Any,
) -> list[float]:
    """Exact match of each completion's <answer> with a gold answer (official HotpotQA EM; 0 without an answer).

    Args are those of `answer_f1_reward`.
    """
    answers = [_final_answer(turns) for turns in _turns(completions, actions, roles)]
    return [0.0 if a is None else exact_match(a, golds) for a, golds in zip(answers, golden_answers, strict=True)]


def format_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    actions: Sequence[Sequence[str]] | None = None,
    roles: Sequence[Sequence[str]] | None = None,
    **kwargs: Any,
) -> list[float]:
    """The env's graduated format score of each completion: 0.25 per protocol tag used and never malformed.

    Args:
        prompts: the prompts (unused).
        completions: the completions, strings or message lists.
        actions: each episode's action texts, where `EnvRollout` produced the completions (the score then
            covers every turn, as the env's does, a CoDA episode's executor turns included).
        roles: the role that took each action, where `EnvRollout` produced the completions (each turn is parsed
            with its role's tags, as the env parses it).
        **kwargs: the other columns and TRL's own arguments (ignored).
    """
    scores = []
    for turns in _turns(completions, actions, roles):
        parsed = [parse_action(turn, role) for role, turn in turns]
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


class _ActedRoles(gym.Wrapper):
    """Records which role took each step of the current episode (the env's ``info["acted_role"]``), so the reward
    functions parse each action with its role's tags, as the env did."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.roles: list[str] = []

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self.roles = []
        return self.env.reset(**kwargs)

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.roles.append(str(info.get("acted_role", "agent")))
        return obs, reward, terminated, truncated, info


class TRLVLLMSampler(TokenizerContext):
    """`Sampler` over the vLLM generation of a TRL trainer built with ``use_vllm=True`` (``trainer.vllm_generation``).

    One `generate` call is one ``generation.generate(prompt_ids, None, 1)``: vLLM samples with the trainer's settings
    (temperature, top_p, top_k, ``generation_kwargs``) and up to its ``max_completion_length`` tokens, which the
    agent must use as `SamplingParams.max_new_tokens` (`EnvRollout` does). The params' seeds are not passed on (TRL's
    generate takes none). A completion is cut right after the token that completes the first stop string, as
    `HFSampler` cuts it; its log-probs are vLLM's for the sampled tokens (NaN where vLLM reports none).

    Args:
        generation: the trainer's ``vllm_generation`` (anything with TRL 1.16's ``generate(prompts, images,
            num_generations) -> (prompt_ids, completion_ids, logprobs, logprob_token_ids)``).
        tokenizer: the trainer's tokenizer.
        max_context: most tokens a row may hold; longer prompts are left-truncated.
    """

    def __init__(self, generation: Any, tokenizer: Any, max_context: int) -> None:
        self.generation = generation
        self._tokenizer = tokenizer
        self._max_context = max_context

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt in one call of the trainer's vLLM generation."""
        if not prompts:
            return []
        rows = [[int(t) for t in p] for p in prompts]
        rows = [ids[overflow(len(ids), params.max_new_tokens, self.max_context) :] for ids in rows]
        _, completion_ids, logprobs, _ = self.generation.generate(rows, None, 1)
        if logprobs is None:
            logprobs = [None] * len(completion_ids)
        return [self._completion(ids, lps, params) for ids, lps in zip(completion_ids, logprobs, strict=True)]

    def _completion(
        self, token_ids: Sequence[int], logprobs: Sequence[Any] | None, params: SamplingParams
    ) -> Completion:
        ids = [int(t) for t in token_ids]
        # TRL gives each token a list of log-probs, the sampled token's first; None where vLLM had none
        firsts = [lp[0] if isinstance(lp, (list, tuple)) else lp for lp in logprobs or [None] * len(ids)]
        logps = [math.nan if lp is None else float(lp) for lp in firsts]
        decode = self._tokenizer.decode
        end, cut = len(ids), False
        if params.stop and cut_at_stop(decode(ids, skip_special_tokens=True), params.stop)[1]:
            end = next(
                n
                for n in range(1, len(ids) + 1)
                if cut_at_stop(decode(ids[:n], skip_special_tokens=True), params.stop)[1]
            )
            cut = True
        text, _ = cut_at_stop(decode(ids[:end], skip_special_tokens=True), params.stop)
        reason = "length" if not cut and len(ids) >= params.max_new_tokens else "stop"
        return Completion(text, tuple(ids[:end]), tuple(logps[:end]), reason)


def _check_vllm_layout(trainer: Any) -> None:
    """Refuse the vLLM settings whose generate is a collective call: every process would have to call it as often
    as the others, and the episodes of different processes take different numbers of turns."""
    args = trainer.args
    mode = getattr(args, "vllm_mode", "colocate")
    processes = getattr(trainer.accelerator, "num_processes", 1)
    tensor_parallel = getattr(args, "vllm_tensor_parallel_size", 1)
    if (mode == "server" and processes > 1) or (mode == "colocate" and tensor_parallel > 1):
        raise NotImplementedError(
            f"EnvRollout cannot sample with vLLM in vllm_mode={mode!r} with {processes} processes and "
            f"vllm_tensor_parallel_size={tensor_parallel}: vLLM's generate is then a collective call, and multi-turn "
            "episodes make the processes call it unequally often. Use vllm_mode='colocate' with "
            "vllm_tensor_parallel_size=1, one training process in server mode, or use_vllm=False."
        )


class EnvRollout:
    """A TRL `rollout_func` that plays each prompt's question as one RAGEnv episode with the trainer's model.

    TRL hands a rollout function the per-process list of prompts (each already repeated `num_generations` times) and
    the trainer; this one plays one episode per prompt (`SearchR1Agent` for the flat protocol, `CodaAgent` for CoDA:
    real searches through the env's retriever) and returns one row per episode, as TRL 1.16 lays rows out: one
    context, ``prompt_ids`` (its chat-template prompt) then ``completion_ids`` (every later token of it), with
    ``logprobs`` (sampling log-probs, 0 on the env's tokens) and ``env_mask`` (1 on sampled tokens, 0 on the env's;
    TRL multiplies its completion mask by it, so the loss covers sampled tokens only). Which context:
    - flat: the episode's one growing context: the model's turns (1) and the env's ``<information>`` (0).
    - CoDA: the planner's context (`trained_context`): its turns (1) and what the env wrote into it, each task's
      ``<result>`` and any invalid-action message (0). The executors' contexts are not in the row: each was sampled in
      a context of its own (instructions and one task, then searches), and TRL scores a row in one forward pass over
      one context, so they cannot be appended to the planner's. TRL therefore trains the planner only: the episode
      reward (which depends on what the executors found) reaches the planner's tokens, and the executors' tokens get
      no gradient. They stay in `trajectories` (their `Generation`s, masks and log-probs); our own trainers
      (``python -m algos.grpo --protocol coda`` and the others) train both roles on the episode reward, as CoDA does.
    The extra fields ``env_reward``, ``actions`` (every action, executor turns included), ``roles`` (who took each)
    and ``num_searches`` go to the reward functions.

    Sampling: when the trainer was built with ``use_vllm=True``, every turn of every episode is one call of its vLLM
    generation (`TRLVLLMSampler` over ``trainer.vllm_generation``, the object TRL's own generation calls, whose
    weights TRL syncs before each rollout call) with TRL's settings: temperature, top_p, top_k, ``generation_kwargs``,
    and ``max_completion_length`` tokens a turn, cut right after the turn's tool call (``generation_kwargs={"stop":
    ["</search>", "</answer>", "</task>"], "include_stop_str_in_output": True}`` spares vLLM the tokens after it).
    vLLM's generate is a collective call in server mode across processes and in colocate mode with tensor
    parallelism, which episodes of unequal length cannot honour: those settings are refused. With
    ``vllm_enable_sleep_mode`` TRL's generate wakes the engine by pushing the weights again, so each turn pays a weight
    push. Without vLLM the trainer's model samples through `HFSampler` with ``max_new_tokens`` and ``temperature``.

    Args:
        env_id: registered id of an env of either protocol (e.g. "RedCoda-HotpotQA-v0", "RedCoda-HotpotQA-CoDA-v0").
        max_new_tokens: tokens sampled per turn (a turn also stops after its tool call's closing tag); without vLLM.
        temperature: sampling temperature; without vLLM.
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
        self.env = _ActedRoles(gym.make(env_id, **env_kwargs))
        self.protocol: str = self.env.unwrapped.protocol
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
        self.max_context_tokens = max_context_tokens
        self._envs: list[_ActedRoles] = [self.env]
        self._index: dict[str, int] = {}
        self.trajectories: list[Trajectory] = []
        """The episodes of the last call, in prompt order (every context of each, executors' included)."""

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

    def _sampler(self, trainer: Any) -> tuple[Sampler, SamplingParams]:
        """The trainer's vLLM generation when it uses vLLM, else its model through `HFSampler`, with the per-turn
        sampling parameters that go with it."""
        if getattr(trainer, "use_vllm", False):
            _check_vllm_layout(trainer)
            generation = trainer.vllm_generation
            max_new = generation.max_completion_length or self.params.max_new_tokens
            params = SamplingParams(max_new_tokens=max_new, temperature=generation.temperature, top_p=generation.top_p)
            return TRLVLLMSampler(generation, trainer.processing_class, self.max_context_tokens), params
        from agents.samplers.hf import HFSampler

        model = trainer.accelerator.unwrap_model(trainer.model)
        # no cache between calls: the weights change after every optimizer step
        return HFSampler(model, trainer.processing_class, cache_tokens=0), self.params

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        """Play one episode per prompt; return TRL's token fields plus the extra fields for reward functions."""
        indices = [self._question_index(p) for p in prompts]
        while len(self._envs) < len(prompts):
            self._envs.append(_ActedRoles(gym.make(self.env_id, **self.env_kwargs)))
        sampler, params = self._sampler(trainer)
        agent_type = SearchR1Agent if self.protocol == "flat" else CodaAgent
        agent = agent_type(sampler, params, max_context_tokens=self.max_context_tokens)
        envs_used = self._envs[: len(prompts)]
        self.trajectories = agent.rollout(envs_used, indices)
        out: dict[str, list] = {
            key: []
            for key in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward", "actions", "roles")
        }
        out["num_searches"] = []
        for trajectory, env in zip(self.trajectories, envs_used, strict=True):
            context = trained_context(trajectory)
            start = context.loss_mask.index(1) if 1 in context.loss_mask else len(context.token_ids)
            out["prompt_ids"].append(list(context.token_ids[:start]))
            out["completion_ids"].append(list(context.token_ids[start:]))
            out["logprobs"].append(list(context.sample_logprobs[start:]))
            out["env_mask"].append(list(context.loss_mask[start:]))
            out["env_reward"].append(float(trajectory.reward))
            out["actions"].append(list(trajectory.actions))
            out["roles"].append(list(env.roles))
            out["num_searches"].append(int(trajectory.info.get("num_searches", 0)))
        return out


def trained_context(trajectory: Trajectory) -> Generation:
    """The context of an episode that its TRL row holds: the flat agent's one context, or the CoDA planner's (the
    executors' contexts are in the trajectory, outside the row)."""
    (context,) = [g for g in trajectory.generations if g.role in ("agent", "planner")]
    return context
