"""The sections of a run's settings: one frozen dataclass per ``--help`` group, each field's docstring its help.

`algos.config.Config` holds one of each (``config.env.top_k``, ``config.optim.lr``, ...); its flags keep the
fields' own names (``--top-k``, ``--lr``), since flat names are unique across the sections. Presets, ``--config``
files and a run's saved config name settings flat too (`SECTION_OF` says where each lives). Derived values that read
one section are its properties (``config.env.env_id``, ``config.run.output_dir``); those that combine sections are
`Config`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro

__all__ = [
    "SECTION_OF",
    "SECTIONS",
    "AlgoName",
    "EnvSettings",
    "ModelSettings",
    "OptimSettings",
    "PresetName",
    "RLSettings",
    "RunSettings",
    "SFTSettings",
]

PresetName = Literal["gpu", "cpu", "tiny"]
AlgoName = str
"""A registered algorithm's name (`algos.registry`: grpo, grpo_sft, red_grpo, grpo_expert, sft, ppo, archer and any
another package registers); `Config.validate` refuses one that is not."""


@dataclass(frozen=True)
class EnvSettings:
    """The environment: its questions, corpus, retriever and turn limits."""

    env: Annotated[str | None, tyro.conf.arg(aliases=("--env-id",))] = None
    """Registered env id (RedCoda-HotpotQA-v0, RedCoda-QueryRewrite-v0, ...); None means the protocol's HotpotQA env."""
    protocol: Literal["flat", "coda"] = "flat"
    """Env protocol and agent: flat (Search-R1 agent) or coda (Planner/Executor agent)."""
    split: str = "train"
    """HotpotQA split the questions (and the oracle demonstrations) come from."""
    data_path: str | None = None
    """An official data file (HotpotQA JSON, or JSON lines) to train on instead of the bundled split."""
    corpus_path: str | None = None
    """A Search-R1-format corpus file (JSON lines of {"id", "contents"}) to search instead of the bundled corpus."""
    retriever: str = "bm25"
    """Retriever of the env: bm25, bm25-matrix, bm25-python (no JVM), dense, hybrid, or a server URL (unused with
    corpus=distractor)."""
    retriever_timeout: float = 30.0
    """Server URL only: seconds allowed for each retrieval request."""
    retriever_retries: int = 2
    """Server URL only: retries of a failed retrieval request (a search waits at most timeout x (retries + 1))."""
    max_retrieval_error_rate: float = 0.5
    """Stop the run when more than this share of a step's searches failed (a dead or hung retriever; 1: never)."""
    corpus: Literal["pooled", "distractor"] = "pooled"
    """Env corpus setting: pooled (search the whole corpus) or distractor (each question's own paragraphs)."""
    top_k: int = 3
    """Passages per search."""
    max_passage_words: int = 80
    """Words kept of each passage."""
    max_search_turns: int = 2
    """Searches an episode (flat) or an executor task (coda) may make before it must answer."""
    max_planner_turns: int = 4
    """coda: planner turns per episode."""
    instructions: Literal["search-r1", "short"] = "search-r1"
    """System prompts of the env: search-r1 (Search-R1's prompt with <refine>) or short (the same protocol in half
    the tokens: every context starts with them)."""
    observation_format: Literal["redcoda", "search_r1"] = "redcoda"
    """How search results read: redcoda (Doc 1 (Title: "..") text, cut to max_passage_words) or search_r1 (Search-R1's
    trainer's Doc 1(Title: "..") text, whole passages: to go on training or evaluating a Search-R1 checkpoint)."""
    question_after_results: bool = False
    """Each search's results end with the context's question line again (an executor's: its task), so the answer is
    written right after the words that say what is asked; no generated token pays for it (`--restate-question` has
    the model write the question itself)."""
    query_action_format: Literal["tag", "raw"] = "tag"
    """Query-rewrite env only: tag (the query inside <query>..</query>) or raw (the whole reply is the query)."""
    num_questions: int | None = None
    """Train on the first N questions of the split only; None uses them all."""

    @property
    def env_id(self) -> str:
        """Registered env id: ``env``, or the protocol's HotpotQA env."""
        if self.env:
            return self.env
        return "RedCoda-HotpotQA-CoDA-v0" if self.protocol == "coda" else "RedCoda-HotpotQA-v0"

    @property
    def is_query_rewrite(self) -> bool:
        """Whether the env is the one-step query-rewrite task (its own arguments; the agent writes <query>)."""
        return self.env_id.startswith("RedCoda-QueryRewrite")

    @property
    def max_turns(self) -> int:
        """Flat episodes: the searches plus the answer turn."""
        return self.max_search_turns + 1

    @property
    def max_executor_turns(self) -> int:
        """coda executor tasks: the searches plus the answer turn."""
        return self.max_search_turns + 1


@dataclass(frozen=True)
class ModelSettings:
    """model and sampler: the policy's weights, their device and dtype, and what samples the rollouts."""

    model: str | None = None
    """Hugging Face id or local directory; None is the bundled SmolLM2-135M-Instruct; "tiny" a tiny random Llama."""
    device: str | None = None
    """torch device; None means cuda when available, else cpu."""
    bf16: bool | None = None
    """bfloat16 autocast for every forward pass (weights and optimizer stay float32); None means on with CUDA."""
    lora: bool = False
    """Train a LoRA adapter (peft) instead of every weight."""
    lora_rank: int = 16
    """LoRA rank r."""
    lora_alpha: int = 32
    """LoRA scaling alpha."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names that get a LoRA adapter."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the policy's weights, gradients and AdamW state: float32 (master weights; bf16 compute comes from
    --bf16 autocast), or bfloat16 (half the memory of each; updates smaller than bfloat16's resolution of a weight,
    about 0.4% of it, are lost, so keep lr well above 1e-6 or use float32 master weights for long runs)."""
    memory_check: bool = True
    """Print the run's memory estimate per device at start (weights, gradients, optimizer state, activations, KV
    cache) and what it writes to disk, and refuse, in one line, a run whose estimate exceeds the device's memory or
    whose checkpoints, final model and outputs exceed the run directory's free space (algos/run/disk.py)."""
    max_context_tokens: int = 4096
    """Context length of the agent and sampler; an episode whose context would outgrow it ends truncated."""
    sampler: Literal["hf", "vllm", "openai"] = "hf"
    """What samples the rollouts: hf (the training model itself through transformers, `agents.samplers.hf`), vllm (a
    vLLM engine in this process on the same GPU, which receives the policy's weights after updates, see
    sync_weights_every), or openai (an OpenAI-compatible server: evaluation only, since trained weights cannot reach
    it; `python -m benchmarks.evaluate --sampler openai`)."""
    sampler_batch_size: int | None = None
    """Rows per sampler forward pass (on a GPU also the largest row bucket of the captured decode-step graphs); None:
    64 on a CPU, and on a GPU the most of 64, 128 and 256 that the step's episodes fill and whose run's memory
    estimate fits in the device's free memory (`algos.run.memory.sampler_rows`; the choice is logged at start)."""
    sampler_decode: Literal["auto", "dynamic", "static", "graphs"] = "auto"
    """The transformers sampler's decode steps: dynamic (the model's forward over a growing cache), graphs (one CUDA
    graph replay per step over static key/value buffers; GPU; Llama, Qwen2 and Mistral layers without a sliding
    window), static (the same buffers without graphs), or auto (graphs on a GPU and static on a CPU where the model
    allows them, the fastest on each; else dynamic; the choice is logged at start). See agents/samplers/hf.py."""
    sync_weights_every: int = 1
    """vllm: push the policy's weights to the engine after every N updates (between pushes it samples from weights
    up to N-1 updates old; the clipped objective's ratio uses old log-probs recomputed by the training model)."""
    vllm_gpu_memory_utilization: float = 0.4
    """vllm: share of the GPU's memory the engine may take (weights and KV cache); the rest is the trainer's. On a
    CPU, vLLM's CPU build sizes its KV cache from this share of the machine's memory (of each rank's engine)."""
    vllm_kv_cache_gib: float | None = None
    """vllm: the engine's KV cache in GiB (vLLM's kv_cache_memory_bytes), in place of a share of the device's memory:
    two ranks' engines on one CPU machine need it (each takes the share of the whole memory otherwise); None: the
    share. The memory estimate counts it before the engine starts."""
    max_sampler_error_rate: float = 0.1
    """Stop the run when more than this share of a step's episodes had a failed generation (1: never)."""

    @property
    def torch_device(self) -> str:
        """The device actually used."""
        if self.device:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def use_bf16(self) -> bool:
        """Whether forward passes run under bfloat16 autocast."""
        return self.bf16 if self.bf16 is not None else self.torch_device.startswith("cuda")


@dataclass(frozen=True)
class OptimSettings:
    """optimisation: the run's length, the optimizer and the forward/backward passes."""

    steps: int = 480
    """Training steps (one collected batch and one optimizer step each)."""
    max_train_minutes: float | None = None
    """Training-time budget: no step starts that would end past it (estimated from the last step); None: off."""
    lr: float = 1e-6
    """AdamW learning rate (the peak one with lr_schedule linear)."""
    lr_schedule: Literal["constant", "linear", "cooldown"] = "constant"
    """constant; linear: decays from lr to lr / 10 over the run, which ends at --steps or at --max-train-minutes,
    whichever comes first (so a time-bounded run ends on small, settling updates); cooldown: constant for the
    first 80% of the run, then the same straight line to lr / 10 (the final model is not one large update away
    from a quite different one)."""
    weight_average: float | None = None
    """Decay of an exponential moving average of the trainable weights, updated after every step (its first steps
    average over fewer: the decay is min(weight_average, (1 + step) / (10 + step))); the final model and the held-out
    evaluation are the average. None: the last step's weights."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    micro_batch_tokens: int = 16384
    """Padded tokens per forward/backward micro-batch; gradients accumulate over micro-batches."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (non-reentrant
    checkpointing): activation memory falls from every layer's to one layer's plus each layer's input, for about one
    extra forward pass of compute."""
    context_grad: bool = True
    """Backpropagate through the context too (prompt, passages, observations). --no-context-grad (the cpu preset's
    value): the loss's gradient flows through the model's own tokens only (same log-probs, about half the
    forward/backward time on multi-turn contexts, `algos.batch.scored_hidden`; with the cpu preset's answer-only
    demonstrations the main job takes 2.4x the steps in its budget and learns more, benchmarks/README.md)."""
    update_epochs: int = 1
    """Optimizer steps per collected batch (PPO epochs over the whole batch; after the first the ratio leaves 1)."""
    term_grad_norms: bool = True
    """Log each loss term's gradient norm (rl/grad_norm, sft/grad_norm), reduced over the ranks: keeps a copy of the
    RL gradient while the SFT term's accumulates (counted by the memory check; --no-term-grad-norms drops it)."""


@dataclass(frozen=True)
class RLSettings:
    """RL: the rollouts of each step and the policy-gradient loss."""

    questions_per_step: int = 32
    """Distinct questions (prompts) per step."""
    group_size: int = 2
    """Episodes per question (G of GRPO)."""
    rollout: Literal["group", "tree"] = "group"
    """How a question's group_size episodes are played: group (independent episodes, GRPO), or tree (Tree-GRPO:
    tree_roots independent episodes, then rounds in which each tree's episodes branch after a search, replaying the
    shared turns instead of sampling them again; each episode's advantage is its reward normalised within its tree
    plus within its question's group, so the turns it shares get step-level credit; `agents.tree`)."""
    tree_roots: int = 2
    """tree: independent episodes (trees) per question; group_size must be tree_roots x (1 + rounds x tree_branches)."""
    tree_branches: int = 1
    """tree: continuations sampled from the node each tree picks in a round (the branching factor)."""
    tree_branch_turns: tuple[int, ...] = ()
    """tree: after which of an episode's searches it may branch (1: after the first search's results); empty: any."""
    tie_probe_questions: int | None = None
    """Questions per step while the last step's rollouts all tied (every group's rewards equal, so the policy
    gradient is exactly 0): a small probe keeps RED's entropy and accuracy estimates alive at a fraction of the
    cost, and the full batch returns as soon as a group's rewards differ; None: always questions_per_step."""
    max_new_tokens: int = 256
    """Tokens sampled per turn at most."""
    temperature: float = 1.0
    """Sampling temperature (the training log-probs use the same one)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    clip_eps: float = 0.2
    """PPO ratio clip (lower, and upper unless clip_eps_high is set)."""
    clip_eps_high: float | None = None
    """Upper ratio clip (DAPO clip-higher); None uses clip_eps."""
    advantage_std_scale: bool = True
    """Divide advantages by the group std (GRPO); False only centres them (Dr. GRPO), so an advantage keeps the size
    of the reward gap it comes from (with 2 episodes a question the std division makes every untied pair +-0.707)."""
    advantage: str | None = None
    """Advantage estimator, by name (`algos.objectives`): group (GRPO), dr_grpo, rloo, reinforce_pp, tree, gae (PPO's),
    q_minus_v (ArCHer's) or one another package registers; None: the algorithm's own (tree under --rollout tree)."""
    policy_loss: str = "clip"
    """Policy-gradient loss, by name: clip (the clipped token ratio), gspo (the context's ratio), reinforce."""
    loss_agg: str = "token-mean"
    """How the policy loss's token values become one number: token-mean (every sampled token of the batch alike),
    signal-token-mean (divided by the sampled tokens of the contexts whose advantage is not 0, DAPO's: tied groups then
    cost the RL term nothing against SFT's), seq-mean-token-mean (each context alike) or seq-mean-token-sum
    (Dr. GRPO)."""
    max_resample_batches: int = 0
    """Dynamic sampling (DAPO): while fewer than questions_per_step groups carry a non-zero advantage, play up to this
    many more batches of new questions (each only as many as are missing) and keep the groups with a signal, dropping
    tied ones, before the update; 0: off (tied groups stay in the batch)."""
    question_draw: Literal["all", "reachable"] = "all"
    """Which training questions the rollouts draw: all, or reachable (those whose answer BM25 shows to the question as
    a query, or to one more search of a gold title the question or those results name, and yes/no questions: the
    difficulty table of `algos.difficulty`, made once per env settings); the demonstrations are unchanged."""
    search_credit: float = 0.0
    """Per-search credit (`algos.objectives.credit`): weight of each search turn's own advantage (the share of gold
    titles
    it brought first, minus repeat_penalty for a repeated query, centred among its group's searches at the same
    position), added on that turn's tokens only; 0: off."""
    repeat_penalty: float = 0.5
    """search_credit: subtracted from the reward of a search whose query the episode searched before."""
    skip_zero_advantage: bool = True
    """Leave contexts whose advantage is 0 out of the policy-gradient pass (their gradient is exactly 0)."""
    old_logp: Literal["auto", "sampler", "recompute"] = "auto"
    """Old log-probs: the sampler's, or recomputed with the training model; auto recomputes under bf16 and with vllm."""
    tis_cap: float | None = None
    """Truncated importance sampling: each token's pg term times min(exp(old_logp - sampler_logp), this); None: off."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the frozen initial model (0: off, no reference model kept)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1/k2/k3)."""
    recall_reward: float = 0.0
    """Weight of the evidence recall in the episode reward (the share of gold titles the episode's searches
    returned, `envs.rewards`): a credit for the search itself, beside the answer's 6*F1; 0 leaves it out."""


@dataclass(frozen=True)
class SFTSettings:
    """SFT weighting: the SFT term on oracle demonstrations, its weight (RED) and the demonstrations."""

    sft_coef: float = 0.1
    """Coefficient of the SFT cross-entropy on oracle demonstrations (times the rule's weight)."""
    red_max_factor: float = 5.0
    """RED's G: bound of each factor; the weight lies in [1, G^2]."""
    red_decay: float = 0.99
    """RED's EMA decay of both entropies (with --red-window 0)."""
    red_window: int = 0
    """RED: 0 tracks both entropies by EMAs (--red-decay) and reads one step's accuracy; K >= 3 tracks them over the
    last K steps (mean, slope beyond its standard error) and reads the mean accuracy of those steps."""
    red_use_accuracy: bool = True
    """RED: include the batch-accuracy factor."""
    sft_batch_size: int = 8
    """Oracle demonstrations (contexts) in each step's SFT minibatch."""
    sft_planner_share: float | None = None
    """CoDA: the share of each SFT minibatch drawn from the planner's contexts, the rest from the executors';
    None: drawn from all contexts alike (one planner context per executor context in the oracle's episodes)."""
    sft_mix: Literal["oracle", "questions"] = "oracle"
    """Which demonstrations the SFT term draws from: every correct, grounded oracle episode (yes/no balanced), or
    (questions) those cut to the question kinds' shares of the training split (bridge, comparison, yes/no): the
    oracle grounds nearly every comparison but about half the bridge questions (`algos.sft_data.mix_like_questions`)."""
    sft_data: str | None = None
    """JSON lines of demonstrations (from `python -m agents.oracle` or this trainer's cache); None builds them."""
    sft_num_demos: int | None = None
    """Oracle episodes to generate when building demonstrations; None means every question of the split."""
    quote_words: int = 12
    """Words of evidence the demonstrations quote in <refine> before answering; 0: they answer without a quote."""
    follow_bridge: bool = False
    """Demonstrations search a missing gold title that the question or the results name even when the answer is
    already shown, so the second query names the bridge entity wherever it can (`agents.oracle`)."""
    min_searches: int = 1
    """Demonstrations search at least this many times per episode (flat) or task (coda) before answering, where a
    query copied from the question or the results remains: 2 makes every episode search twice (`agents.oracle`)."""
    results_queries: bool = False
    """Demonstrations' later queries name a gold title that the results name and the question does not (the bridge
    entity) before one the question names, and the second search `min_searches` adds after the answer already shows
    is made only with such a title (`agents.oracle`)."""
    restate_question: bool = False
    """Demonstrations open each answering turn with <think> and the question it answers (the executor's: its task),
    so the answer is written right after the words that say what is asked (`agents.oracle`)."""


@dataclass(frozen=True)
class RunSettings:
    """run: its name, seed, directory, checkpoints, logging and held-out evaluation."""

    preset: PresetName = "gpu"
    """Named set of defaults (gpu, cpu, tiny); read before the other flags, which override it."""
    algo: tyro.conf.Suppress[AlgoName] = "red_grpo"
    """Fixed by the entry point (or ``python -m algos.train --algo NAME``), a name in `algos.registry`: grpo (no SFT),
    grpo_sft (fixed SFT), red_grpo (RED), grpo_expert (oracle episodes inside the groups, algos.learners.expert), sft
    (SFT only: a warm start), ppo (value head + GAE, algos.ppo), archer (utterance-level critic, algos.archer)."""
    seed: int = 0
    """Seeds the data order, sampling, SFT minibatches and model initialisation."""
    run_dir: str | None = None
    """Where checkpoints, metrics.jsonl and the final model go; None means runs/<run_name>."""
    run_name: str | None = None
    """Name of the run (wandb and the default run_dir); None means <algo>-<preset>-seed<seed>."""
    resume: bool = False
    """Continue from the newest good checkpoint in run_dir, exactly as if the run had never stopped."""
    resume_changed: tuple[str, ...] = ()
    """Settings a --resume may change from the checkpoint's, by name (lr group-size ...); a resume that changes a
    setting not named here is refused, since the steps before and after would train two different runs into one."""
    save_every: int = 50
    """Write a checkpoint every N steps (0: only the final one)."""
    keep_checkpoints: int = 3
    """How many step checkpoints to keep (the newest)."""
    push_to_hub: str | None = None
    """A Hugging Face Hub repo (user/name) to upload final/ to at the end: weights, tokenizer, model card, config."""
    wandb: bool = True
    """Log to Weights & Biases (offline unless logged in; WANDB_MODE is respected)."""
    wandb_project: str = "redcoda"
    """wandb project."""
    progress: bool = True
    """Show a progress bar."""
    verbose: bool = False
    """Keep third-party libraries' INFO lines and progress bars in the log (bm25s, httpx, weight loading)."""
    eval_questions: int = 100
    """Held-out questions on which the trained model and the model it started from are scored (greedy, same env
    settings as training) at the end of the run; 0 skips the evaluation."""
    eval_split: str = "dev"
    """Split of the held-out questions (never the training split)."""
    eval_data_path: str | None = None
    """A data file of held-out questions (with --data-path); None: eval_split of the bundled data."""
    max_eval_error_rate: float = 0.05
    """Fail the held-out evaluation (exit 1, the final model kept) when more than this share of its episodes met a
    sampler or retriever error, rather than report their zeros as the model's scores (1: never)."""
    eval_batch_size: int = 100
    """Episodes per batched evaluation rollout: all of the default held-out questions at once, so that each of the
    sampler's calls can group its rows by the tokens they prefill (`agents.samplers.HFSampler`'s ``pad_limit``)."""
    validation_questions: int = 0
    """The training split's last N questions, held out of training (no rollout or demonstration uses them): at the
    run's end every kept checkpoint is scored on them (greedy, the training env) and the best by answer F1 becomes
    the final model, the later one on a tie. One update can move the greedy policy a long way at this size (a search
    more per question, a different answer to every yes/no question), so the last step is not always the best of the
    last few. 0: the last step's weights are the final model."""
    torch_threads: int | None = None
    """CPU threads for torch; None: the cores other processes leave idle, sampled at start and decided again between
    steps from their average load (one thread per process beats several when cores are contended)."""
    fsdp: bool = False
    """Under torchrun: shard the policy's weights, gradients and AdamW state over the ranks (FSDP2, one unit per
    decoder layer) instead of a full copy per rank (DDP), for models whose training state does not fit one device;
    the weights are gathered whole for sampling. One process has nothing to shard and ignores it."""
    dist_timeout_seconds: float = 1800.0
    """Under torchrun: how long a collective waits for the other ranks (one stopped or hung) before the run stops."""

    @property
    def name(self) -> str:
        """Run name: run_name, or <algo>-<preset>-seed<seed>."""
        return self.run_name or f"{self.algo}-{self.preset}-seed{self.seed}"

    @property
    def output_dir(self) -> Path:
        """Run directory: run_dir, or runs/<name>."""
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name


SECTIONS: dict[str, type] = {
    "env": EnvSettings,
    "model": ModelSettings,
    "optim": OptimSettings,
    "rl": RLSettings,
    "sft": SFTSettings,
    "run": RunSettings,
}
"""`Config`'s sections by attribute, in ``--help``'s order."""

SECTION_OF: dict[str, str] = {field.name: attr for attr, cls in SECTIONS.items() for field in dataclasses.fields(cls)}
"""Each setting's flat name (a flag's, a preset's, a config file's key) and the section that holds it."""
