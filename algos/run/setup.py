"""The parts a training run is built from, each from its `Config`: the model (optionally LoRA), the sampler, the
agent, the rollout collector and its questions, the optimizer.

`training_run.TrainingRun` calls these in its constructor, in this order; the env, agent and sampler packages are
imported when a part is built, so importing this module loads none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from agents.records import SamplingParams
from algos.config import Config
from envs.data import DataError

__all__ = [
    "add_lora",
    "build_model",
    "context_limit",
    "make_agent",
    "make_collector",
    "make_optimizer",
    "make_sampler",
    "training_indices",
    "validation_indices",
]


def build_model(config: Config, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The run's starting model and tokenizer on `device` (also the 'before' of the evaluation)."""
    from agents.models import load_model, tiny_model

    dtype = getattr(torch, config.model.param_dtype)  # float32 master weights unless --param-dtype bfloat16
    if config.model.model == "tiny":
        model, tokenizer = tiny_model(seed=config.run.seed, max_context=config.model.max_context_tokens)
        model = model.to(device, dtype)
    else:  # bf16 compute over float32 weights (--bf16) comes from autocast around each forward pass
        model, tokenizer = load_model(config.model.model, dtype=dtype, device=device)
    if config.optim.gradient_checkpointing:
        # non-reentrant: works under autocast, FSDP2 and with inputs that need no gradient (frozen embeddings)
        if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def add_lora(model: torch.nn.Module, config: Config) -> Any:
    """``--lora``: the peft model that injects LoRA layers into `model`'s modules; None without ``--lora``."""
    if not config.model.lora:
        return None
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.model.lora_rank,
        lora_alpha=config.model.lora_alpha,
        lora_dropout=config.model.lora_dropout,
        target_modules=list(config.model.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def context_limit(config: Config, policy: torch.nn.Module) -> int:
    """The agent's and sampler's context length: ``max_context_tokens``, at most the model's positions."""
    return min(config.model.max_context_tokens, int(getattr(policy.config, "max_position_embeddings", 1 << 30)))


def make_sampler(
    config: Config, policy: torch.nn.Module, tokenizer: Any, max_context: int, rows: int | None = None
) -> Any:
    """The sampler of ``--sampler`` over the policy (vLLM: an engine built from ``--model`` that gets its weights);
    `rows`: the transformers sampler's rows per batch (`algos.run.memory.sampler_rows`; None:
    ``--sampler-batch-size``, or a CPU's 64 where that is None)."""
    from agents.samplers.factory import make_sampler as make
    from algos.run.memory import SAMPLER_ROWS

    return make(
        config.model.sampler,
        model=policy,
        tokenizer=tokenizer,
        source=config.model.model,  # vLLM builds from it (None: the bundled model, which VLLMSampler resolves)
        max_context=max_context,
        max_batch_size=rows or config.model.sampler_batch_size or SAMPLER_ROWS[0],
        seed=config.run.seed,
        decode=config.model.sampler_decode,
        dtype="bfloat16" if config.model.use_bf16 or config.model.param_dtype == "bfloat16" else "float32",
        gpu_memory_utilization=config.model.vllm_gpu_memory_utilization,
        kv_cache_gib=config.model.vllm_kv_cache_gib,
    )


def make_agent(config: Config, sampler: Any, max_context: int) -> Any:
    """The protocol's agent over `sampler`: CoDA's planner and executors, the flat Search-R1 agent, or for the
    query-rewrite env a context agent that stops after its one ``</query>``."""
    from agents.search_agents import CodaAgent, ContextAgent, SearchR1Agent

    params = SamplingParams(
        max_new_tokens=config.rl.max_new_tokens, temperature=config.rl.temperature, top_p=config.rl.top_p
    )
    agent_cls = CodaAgent if config.env.protocol == "coda" else SearchR1Agent
    if config.env.is_query_rewrite:  # one <query> turn: a plain context agent that stops after </query>
        agent_cls, params = ContextAgent, dataclasses.replace(params, stop=("</query>",))
    return agent_cls(sampler, params, max_context_tokens=max_context)


def make_collector(config: Config, agent: Any, shard: tuple[int, int]) -> Any:
    """The rollout collector over ``gym.make(config.env.env_id, **config.env_kwargs)``: `shard` (rank, ranks) names this
    rank's share of each step's questions, drawn from `training_indices`."""
    import gymnasium as gym

    import envs  # noqa: F401  (registers the env ids)
    from agents.collector import RolloutCollector
    from agents.tree import TreeShape

    tree = TreeShape(config.rl.tree_roots, config.rl.tree_branches, config.rl.tree_branch_turns)
    return RolloutCollector(
        lambda: gym.make(config.env.env_id, disable_env_checker=True, **config.env_kwargs),
        agent,
        questions_per_batch=config.rl.questions_per_step,
        group_size=config.rl.group_size,
        indices=lambda size: training_indices(config, size),
        seed=config.run.seed,
        shard=shard,
        tree=tree if config.rl.rollout == "tree" else None,
    )


def check_question_lengths(config: Config, env: Any) -> None:
    """Refuse a training question that cannot fit a context by itself: its words and one turn past
    ``max_context_tokens`` (words are a lower bound of tokens), instead of training on prompts cut from the left.
    (Instructions too long for the context are the settings' check; demonstrations too long, `load_demonstrations`'.)

    Raises:
        DataError: naming the data file, the question's place in it and its id.
    """
    from envs import ENV_IDS
    from envs.data import DataError

    if config.env.env_id not in ENV_IDS:  # the QA envs, whose first message holds the question
        return
    room = config.model.max_context_tokens - config.rl.max_new_tokens
    count = len(env.examples) if config.env.num_questions is None else min(config.env.num_questions, len(env.examples))
    for i, example in enumerate(env.examples[:count]):
        words = len(example.question.split())
        if words > room:
            raise DataError(
                f"{env.data_file}: question {i + 1} ({example.id}) is {words} words, more than a context holds with "
                f"a turn (--max-context-tokens {config.model.max_context_tokens}, "
                f"--max-new-tokens {config.rl.max_new_tokens})"
            )


def make_optimizer(
    config: Config, trainable: Sequence[torch.nn.Parameter], learner_groups: list[dict[str, Any]]
) -> torch.optim.AdamW:
    """AdamW over the policy's `trainable` parameters and a learner's own parameter groups (value head, critic)."""
    return torch.optim.AdamW(
        [{"params": list(trainable)}, *learner_groups],
        lr=config.optim.lr,
        betas=config.optim.adam_betas,
        weight_decay=config.optim.weight_decay,
    )


def training_indices(config: Config, size: int) -> Sequence[int]:
    """The questions of a `size`-question training split that rollouts draw from: the first ``num_questions``
    (all when None), less the last ``validation_questions`` (`validation_indices`); with ``question_draw=reachable``
    only those the env can reward (`algos.difficulty`)."""
    end = size - config.run.validation_questions
    if end < 1:
        raise DataError(
            f"--validation-questions {config.run.validation_questions} leaves none of the {size} training questions"
        )
    indices = range(end if config.env.num_questions is None else min(end, config.env.num_questions))
    if config.rl.question_draw == "reachable":
        from algos.difficulty import load_table, reachable

        return reachable(indices, load_table(config.env.env_id, config.env_kwargs))
    return indices


def validation_indices(config: Config, size: int) -> range:
    """The last ``validation_questions`` of a `size`-question training split: held out of training, they choose
    the final model among the kept checkpoints (`algos.run.evaluation.select_checkpoint`)."""
    return range(max(0, size - config.run.validation_questions), size)
