"""ArCHer's learner and settings (`python -m algos.archer` trains it; its step: that module's docstring)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict

from agents.records import Trajectory
from algos.config import Config
from algos.learners.trainer import Trainer
from algos.learners.value import TurnCritic, turn_features, turn_spans
from algos.run.learner import RunParts
from algos.setting_checks import at_least, check_rules, positive, within

__all__ = ["ARCHER_DEFAULTS", "ARCHER_PRESETS", "ArCHerConfig", "ArCHerTrainer", "TurnReplay"]


@dataclass(frozen=True)
class ArCHerConfig(Config):
    """Settings of an ArCHer run: the shared ones and the critic's."""

    gamma: float = 1.0
    """Discount per turn in the critic's TD target."""
    whiten_advantages: bool = True
    """Whiten the turns' advantages over the batch (mean 0, std 1)."""
    critic_lr: float = 1e-3
    """AdamW learning rate of the critic heads."""
    critic_hidden: int = 256
    """Hidden width of the Q and V heads."""
    critic_updates: int = 8
    """Critic gradient steps per training step, each on a minibatch drawn from the replay buffer."""
    critic_batch_size: int = 64
    """Turns per critic minibatch."""
    replay_capacity: int = 4096
    """Turns kept in the replay buffer (oldest dropped first)."""
    target_update_every: int = 4
    """Copy the critic into its target network every N critic updates."""
    target_tau: float = 1.0
    """Target refresh mix, target <- tau * critic + (1 - tau) * target (1.0: a hard copy)."""

    def validate(self) -> None:
        super().validate()
        check_rules(
            self,
            (
                ("gamma", within(0, 1), "in [0, 1]"),
                ("critic_lr", positive, "> 0"),
                ("critic_hidden", at_least(1), ">= 1"),
                ("critic_updates", at_least(1), ">= 1"),
                ("critic_batch_size", at_least(1), ">= 1"),
                ("replay_capacity", at_least(1), ">= 1"),
                ("target_update_every", at_least(1), ">= 1"),
                ("target_tau", lambda v: 0 < v <= 1, "in (0, 1]"),
            ),
        )


ARCHER_DEFAULTS: dict[str, object] = {"group_size": 1, "protocol": "flat"}
"""The entry point's defaults over every preset's (the critic is the baseline: no GRPO groups needed; the flat
protocol whatever the preset's, as the turn-level critic reads one context per episode)."""

ARCHER_PRESETS: dict[str, dict[str, object]] = {
    "gpu": {"questions_per_step": 64},
    "cpu": {"questions_per_step": 4},
    "tiny": {
        "questions_per_step": 4,
        "critic_hidden": 32,
        "critic_updates": 4,
        "critic_batch_size": 16,
        "replay_capacity": 64,
        "target_update_every": 2,
    },
}
"""Per-preset ArCHer defaults over `ARCHER_DEFAULTS` (flags still override them)."""

_BUFFER_KEYS = ("state", "state_action", "reward", "next_state", "done")
"""A batch of turn transitions is a TensorDict of batch size (K,): state, state_action, next_state (K, F);
reward, done (K,)."""


class TurnReplay:
    """A FIFO replay buffer of turn transitions (feature tensors), sampled uniformly with its own generator.

    Args:
        capacity: Turns kept; the oldest are overwritten first.
        feature_size: Width of a turn feature.
        seed: Seeds the sampling generator.
    """

    def __init__(self, capacity: int, feature_size: int, seed: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"replay_capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.data = {
            "state": torch.zeros(capacity, feature_size),
            "state_action": torch.zeros(capacity, feature_size),
            "reward": torch.zeros(capacity),
            "next_state": torch.zeros(capacity, feature_size),
            "done": torch.zeros(capacity),
        }
        self.size, self.position = 0, 0
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.size

    def push(self, turns: TensorDict) -> None:
        """Append turns (overwriting the oldest when full)."""
        for k in range(len(turns["reward"])):
            for key in _BUFFER_KEYS:
                self.data[key][self.position] = turns[key][k]
            self.position = (self.position + 1) % self.capacity
            self.size = min(self.size + 1, self.capacity)

    def sample(self, n: int) -> TensorDict:
        """``n`` turns drawn uniformly with replacement."""
        if not self.size:
            raise ValueError("the replay buffer is empty")
        index = torch.randint(self.size, (n,), generator=self.generator)
        return TensorDict({key: value[index] for key, value in self.data.items()}, batch_size=[n])

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Filled rows and the RNG state as tensors; size and position as ints."""
        tensors = {f"replay.{key}": value[: self.size].clone() for key, value in self.data.items()}
        tensors["replay.rng"] = self.generator.get_state()
        return tensors, {"size": self.size, "position": self.position}

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, int]) -> None:
        """Restore what `state_dict` returned."""
        self.size, self.position = int(state["size"]), int(state["position"])
        for key, value in self.data.items():
            value.zero_()
            value[: self.size] = tensors[f"replay.{key}"]
        self.generator.set_state(tensors["replay.rng"])


class ArCHerTrainer(Trainer):
    """The shared loop with ArCHer's turn-level critic for advantages.

    One step, on the shared loop of `algos.learners.trainer.Trainer` (this file changes only the advantages):

        1. trajectories = the next collector batch's records  # B episodes, each a sequence of turns
        2. encode every turn with a frozen encoder (the initial policy's decoder), one causal pass per context:
             phi(s_k)      = [mean hidden of the context before turn k ; hidden of its last token]      (2H,)
             phi(s_k, a_k) = the same over the context through turn k's last sampled token           (2H,)
           transitions (phi(s_k), phi(s_k, a_k), r_k, phi(s_k+1), done_k): r = the episode reward on the
           episode's last turn (done), 0 before it; turns chain across an episode's generations in record order.
        3. push them into a FIFO replay buffer of turns (``replay_capacity``)
        4. ``critic_updates`` times: a uniform minibatch of ``critic_batch_size`` turns from the buffer, and
             loss_q = sum_i (Q_i(s, a) - [r + gamma * (1 - done) * V_targ(s')])^2        i = 1, 2 (double Q)
             loss_v = (V(s) - min(Q1_targ, Q2_targ)(s, a))^2
           one AdamW step on the critic heads; every ``target_update_every`` critic updates the target heads are
           refreshed: targ <- tau * critic + (1 - tau) * targ (``target_tau`` 1.0 = a hard copy, < 1 = Polyak)
        5. per turn of this batch: A(s_k, a_k) = min(Q1, Q2)(s_k, a_k) - V(s_k), whitened over the batch's turns,
           broadcast to every token the model sampled in the turn
        6. the token-level update: the clipped policy-gradient loss of `algos.objectives.losses.policy_loss` with those
           per-token advantages (REINFORCE with a turn-level baseline on the first epoch, where the ratio is 1),
           [+ KL to the frozen initial model], one AdamW step (``update_epochs`` of them)

    How this differs from the paper:

    - Critic architecture: the paper fine-tunes a RoBERTa-base critic end to end. Here the encoder is frozen
      (the initial policy's decoder, so it shares the policy's tokenizer) and only MLP heads train, on pooled
      features cached in the replay buffer; critic updates are cheap (no transformer pass), but features do not
      adapt. Pooling is the prefix mean plus the last token's hidden state.
    - V's target: the paper's V regresses min(Q1_targ, Q2_targ)(s, a') with a' sampled from the current policy;
      here a is the replayed action (no fresh sampling per critic update), so V tracks the buffer's behaviour
      policy, which lags the current one by at most ``replay_capacity`` turns.
    - Double Q as in the paper (the min of two heads in V's target and in the advantage); target networks for
      the heads, refreshed every n critic updates (hard copy by default; the paper uses Polyak averaging).
    - No separate token-level baseline: the paper optionally learns a token-level value for the actor; here
      every token of a turn shares the turn's advantage.
    - The actor loss is PPO's clipped surrogate (the paper's actor is REINFORCE); with ``update_epochs`` 1 the
      two coincide in gradient.
    - Critic and actor update once per collected batch (the paper warms the critic up and updates the actor
      less often; raise ``critic_updates`` for the same effect).

    The critic heads, their target, the critic's AdamW state, the replay buffer and its sampling RNG are in
    every checkpoint (``learner/*``), so a resumed run continues exactly.
    """

    def progress_fields(self, metrics: dict[str, Any]) -> dict[str, str]:
        return {**super().progress_fields(metrics), "q_loss": f"{metrics.get('critic/loss_q', float('nan')):.3f}"}

    def __init__(self, run: RunParts) -> None:
        super().__init__(run)
        cfg = self.config
        if not hasattr(run.policy, "get_decoder"):
            raise ValueError("ArCHer needs a causal LM with get_decoder() to encode turns")
        source = run.ref_model if run.ref_model is not None else run.policy
        self.encoder = copy.deepcopy(source.get_decoder()).eval().requires_grad_(False)
        feature_size = 2 * int(run.policy.config.hidden_size)
        self.critic = TurnCritic(feature_size, cfg.critic_hidden).to(run.device)
        self.target_critic = copy.deepcopy(self.critic).requires_grad_(False)
        self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
        self.replay = TurnReplay(cfg.replay_capacity, feature_size, seed=cfg.run.seed)
        self.critic_steps = 0
        self.target_updates = 0

    # --- checkpoint --------------------------------------------------------------------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, state = super().state_dict()  # the tie probe's flag
        tensors.update({f"critic.{k}": v for k, v in self.critic.state_dict().items()})
        tensors.update({f"target.{k}": v for k, v in self.target_critic.state_dict().items()})
        for index, slots in self.critic_optimizer.state_dict()["state"].items():
            tensors.update({f"critic_opt.{index}.{name}": torch.as_tensor(v) for name, v in slots.items()})
        replay_tensors, replay_state = self.replay.state_dict()
        tensors.update(replay_tensors)
        state.update({"critic_steps": self.critic_steps, "target_updates": self.target_updates, "replay": replay_state})
        return tensors, state

    def load_state_dict(self, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}

        self.critic.load_state_dict(part("critic."))
        self.target_critic.load_state_dict(part("target."))
        slots: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in part("critic_opt.").items():
            index, name = key.split(".", 1)
            slots.setdefault(int(index), {})[name] = value
        optimizer_state = self.critic_optimizer.state_dict()
        self.critic_optimizer.load_state_dict({"state": slots, "param_groups": optimizer_state["param_groups"]})
        self.replay.load_state_dict(tensors, state["replay"])
        self.critic_steps, self.target_updates = int(state["critic_steps"]), int(state["target_updates"])
        own = ("critic.", "target.", "critic_opt.", "replay.")
        super().load_state_dict(
            {k: v for k, v in tensors.items() if not k.startswith(own)},
            {k: v for k, v in state.items() if k not in ("critic_steps", "target_updates", "replay")},
        )

    # --- the critic --------------------------------------------------------------------------------------
    def encode_turns(self, trajectories: Sequence[Trajectory]) -> tuple[TensorDict, list[tuple[int, int, int]]]:
        """Transitions of every turn of the batch, and where each turn's tokens are: (row, start, end).

        Rows are the batch's generations in `collate_trajectories` order; spans index ``Generation.token_ids``.
        """
        states, actions, rewards, dones, places = [], [], [], [], []
        next_index: list[int] = []
        row = 0
        with torch.no_grad(), self.autocast():
            for trajectory in trajectories:
                first = len(states)
                for generation in trajectory.generations:
                    spans = turn_spans(generation.loss_mask)
                    if spans:
                        ids = torch.tensor([generation.token_ids], device=self.run.device)
                        hidden = self.encoder(input_ids=ids, use_cache=False).last_hidden_state[0]  # (L, H)
                        state, state_action = turn_features(hidden, spans)  # (K, 2H) each
                        states.extend(state.float().cpu())
                        actions.extend(state_action.float().cpu())
                        places.extend((row, start, end) for start, end in spans)
                    row += 1
                count = len(states) - first
                rewards.extend([0.0] * max(count - 1, 0) + ([trajectory.reward] if count else []))
                dones.extend([0.0] * max(count - 1, 0) + ([1.0] if count else []))
                next_index.extend(list(range(first + 1, first + count)) + ([-1] if count else []))
        if not states:
            raise ValueError("no turn in the batch holds a sampled token")
        state = torch.stack(states)  # (K, F)
        next_state = torch.stack([state[i] if i >= 0 else torch.zeros_like(state[0]) for i in next_index])  # (K, F)
        turns = TensorDict(
            {
                "state": state,
                "state_action": torch.stack(actions),  # (K, F)
                "reward": torch.tensor(rewards),  # (K,)
                "next_state": next_state,
                "done": torch.tensor(dones),  # (K,)
            },
            batch_size=[len(state)],
        )
        return turns, places

    def critic_update(self, sample: TensorDict) -> dict[str, float]:
        """One gradient step of the critic heads on a minibatch of turns; refreshes the target every n steps."""
        cfg = self.config
        sample = sample.to(self.run.device)
        with torch.no_grad():
            q_next = sample["reward"] + cfg.gamma * (1.0 - sample["done"]) * self.target_critic.value(
                sample["next_state"]
            )  # (b,)
            v_target = torch.minimum(*self.target_critic.q(sample["state_action"]))  # (b,)
        q1, q2 = self.critic.q(sample["state_action"])  # (b,) each
        loss_q = F.mse_loss(q1, q_next) + F.mse_loss(q2, q_next)
        loss_v = F.mse_loss(self.critic.value(sample["state"]), v_target)
        self.critic_optimizer.zero_grad(set_to_none=True)
        (loss_q + loss_v).backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.optim.grad_clip)
        self.critic_optimizer.step()
        self.critic_steps += 1
        if self.critic_steps % cfg.target_update_every == 0:
            self.refresh_target()
        return {
            "critic/loss_q": float(loss_q.detach()),
            "critic/loss_v": float(loss_v.detach()),
            "critic/q_mean": float(q1.detach().mean()),
        }

    def refresh_target(self) -> None:
        """targ <- tau * critic + (1 - tau) * targ (a hard copy at tau = 1)."""
        with torch.no_grad():
            for target, online in zip(self.target_critic.parameters(), self.critic.parameters(), strict=True):
                target.lerp_(online, self.config.target_tau)
        self.target_updates += 1

    # --- the step ----------------------------------------------------------------------------------------
    def advantage_inputs(
        self, episodes: Sequence[Any], batch: TensorDict, metrics: dict[str, float]
    ) -> dict[str, torch.Tensor]:
        """Encode the batch's turns, push them into the replay buffer, train the critic on it and give each turn's
        ``min(Q1, Q2) - V`` and where its tokens are to the ``q_minus_v`` estimator."""
        cfg = self.config
        turns, places = self.encode_turns(episodes)
        self.replay.push(turns)
        critic_metrics: list[dict[str, float]] = [
            self.critic_update(self.replay.sample(cfg.critic_batch_size)) for _ in range(cfg.critic_updates)
        ]
        with torch.no_grad():
            q = torch.minimum(*self.critic.q(turns["state_action"].to(self.run.device))).cpu()  # (K,)
            v = self.critic.value(turns["state"].to(self.run.device)).cpu()  # (K,)
        metrics |= {
            "critic/v_mean": float(v.mean()),
            "critic/turns": float(len(places)),
            "critic/replay_size": float(len(self.replay)),
            "critic/updates": float(self.critic_steps),
            "critic/target_updates": float(self.target_updates),
        }
        for key in ("critic/loss_q", "critic/loss_v", "critic/q_mean"):
            metrics[key] = sum(m[key] for m in critic_metrics) / max(len(critic_metrics), 1)
        return {"turn_adv": q - v, "turn_spans": torch.tensor(places, dtype=torch.long).reshape(-1, 3)}  # (K,), (K, 3)
