"""Expert trajectories inside the GRPO groups: oracle episodes of a step's questions join their groups off-policy.

The fourth way to mix demonstrations into RL, beside GRPO + fixed SFT, GRPO + RED (an SFT term) and none: as in
LUFFY (arXiv 2504.14945) and David-GRPO (arXiv 2601.21699), a demonstration is a member of its question's group, so
its advantage is measured against the group's own failures, and its tokens get the policy-gradient term of an
off-policy sample (`algos.learners.off_policy`). `ExpertTrainer` states the step; `python -m algos.grpo_expert` runs it.

    python -m algos.grpo_expert --preset tiny --run-dir /tmp/expert-tiny
    python -m algos.grpo_expert --expert-members 1 --expert-shaping 0.1
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from agents.records import Trajectory
from algos import distributed
from algos.config import Config
from algos.learners.off_policy import shaped_expert_loss
from algos.learners.trainer import Trainer
from algos.objectives.advantages import Advantages
from algos.objectives.losses import entropy_estimate
from algos.objectives.policy_losses import LossScale
from algos.objectives.registry import estimator
from algos.run import setup as run_setup
from algos.run.learner import RunParts
from algos.setting_checks import at_least, check_rules, positive
from algos.sft_data import oracle_agent
from algos.step_metrics import Rollouts, rewards_tied

__all__ = ["EXPERT_METRICS", "ExpertConfig", "ExpertTrainer"]


@dataclass(frozen=True)
class ExpertConfig(Config):
    """Settings of a GRPO run with expert (oracle) episodes inside its groups: the shared ones and the experts'."""

    expert_members: int = 1
    """Oracle episodes that join each question's group beside its group_size sampled ones (the oracle is
    deterministic, so more than 1 repeats the same episode: its tokens weigh that many times)."""
    expert_shaping: float = 0.1
    """LUFFY's gamma in the expert tokens' shaped ratio pi / (pi + gamma); smaller lifts unlikely tokens more."""
    grounded_expansion: bool = False
    """Resample the rest of each group's best episode from the earliest point its searches had returned every gold
    title; a continuation that scores more than the group's worst episode replaces it (--rollout group only)."""

    def validate(self) -> None:
        super().validate()
        check_rules(
            self,
            (
                ("expert_members", at_least(1), ">= 1"),
                ("expert_shaping", positive, "> 0"),
            ),
        )
        if estimator(self.advantage).per != "episode":
            raise ValueError(
                f"--advantage {self.advantage} gives token advantages; an expert member needs its episode's: use an "
                "estimator of episode advantages (group, dr_grpo, rloo, tree)"
            )
        if self.grounded_expansion and self.rl.rollout == "tree":
            raise ValueError("--grounded-expansion plays independent episodes: use it with --rollout group")


EXPERT_METRICS = (
    "expert/group_share",
    "expert/members",
    "expert/skipped_share",
    "expert/advantage_mean",
    "expert/reward_mean",
    "expert/token_share",
    "expert/shaped_ratio_mean",
    "expert/prob_mean",
)
"""The metrics every step logs about the expert members (NaN where a step had none to measure)."""


class ExpertTrainer(Trainer):
    """The shared loop with oracle episodes as off-policy members of the GRPO groups.

    One step, on the shared loop of `algos.learners.trainer.Trainer`:

        1. trajectories = the next collector batch's records  # G sampled episodes for each of B questions
           [--grounded-expansion: trajectories = expand(trajectories), below]
        2. experts = oracle.rollout(same envs, same questions)  # expert_members per question, the env's reward;
                                                                # failed ones (F1 0, ungrounded, too long) skipped
        3. adv = estimator(rewards of both, group_id)            # an expert is one more member of its group
        4. loss = loss_pg(on-policy tokens: clipped, r = pi / pi_old)
                + loss_expert(expert tokens: -adv * pi / (pi + gamma), unclipped)   # one token mean over both
                [+ kl_coef * loss_kl(on-policy tokens)]
        5. backward micro-batch by micro-batch, clip, AdamW (as every learner)

    Decisions a reader may need:

    - Where the experts come from: the oracle (`agents.oracle.OracleAgent`, the settings of the run's
      demonstrations) plays each question of the step live, through this rank's own envs (the collector's, after
      its rollouts ended), so an expert's episode is the env's, scored by the env's reward like any other. The
      cached demonstrations (`algos.sft_data`) are not used: they cover only the split's first ``sft_num_demos``
      questions, keep no reward, and are cut to balance yes/no answers and question kinds, so most of a step's
      questions would have none. An oracle episode that fails (F1 0, or not grounded: it could not have been played
      from its own context) or that does not fit the model's context is skipped; its group keeps only its sampled
      episodes. A group never spans ranks, so the experts of a rank's groups are played on that rank.
    - The importance weight (`algos.learners.off_policy`): the oracle is not a sampling policy and has no log-probs, so
      its behaviour probability is taken as 1 and the token's ratio is pi itself, shaped as LUFFY's
      ``pi / (pi + gamma)`` so that the expert tokens the policy finds unlikely keep their gradient; no clip on expert
      tokens. On-policy
      tokens keep the clipped loss (and truncated importance weights under ``--tis-cap``); one token mean over every
      sampled and expert token of the batch. The KL term (``--kl-coef``) sees only on-policy tokens: its estimators
      assume tokens drawn from the policy.
    - What the step's metrics say: rewards, F1 and the other episode metrics are the sampled episodes' only; the
      RL entropy estimate and, with recomputed old log-probs, the sampler mismatch are over the sampled tokens only
      (an expert token's log-prob 0 is a convention, not a measurement). A step counts as tied (the next one then
      collects a probe batch, ``--tie-probe-questions``) only when the groups tie with their expert members in.
      ``rl/clip_fraction`` and ``rl/approx_kl`` are over the on-policy tokens; `EXPERT_METRICS` describe the experts.
    - Grounded expansion (``--grounded-expansion``, `expand`): the group's best sampled episode among those whose
      searches returned every gold title while they went on is replayed to the earliest point it had all its
      evidence (`evidence_point`), and the policy samples the rest once more; a continuation that scores more than
      the group's worst episode takes its place. A near miss (full evidence, a poor answer) so gets a second try at
      reading what it found, and the group one more on-policy episode that had the evidence in view (logged as
      ``expansion/*``). Not with tree rollouts.
    """

    def __init__(self, run: RunParts) -> None:
        super().__init__(run)
        self.oracle = oracle_agent(self.config, run.tokenizer)  # the demonstrations' oracle
        self.max_context = run_setup.context_limit(self.config, run.policy)
        self._expert_counts: dict[str, float] = {}

    # --- the experts ---------------------------------------------------------------------------------------
    def expert_episodes(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
        """The oracle's episodes of the questions of `trajectories`, in their groups; and how many were played.

        Each question (group) gets ``expert_members`` oracle episodes with its ``group_id``; the failed ones (see
        the class docstring) are left out.
        """
        members = self.config.expert_members
        questions = {t.group_id: t.example_index for t in trajectories}  # group -> question, in order
        jobs = [(group, index) for group, index in questions.items() for _ in range(members)]
        envs = self.run.collector.envs
        played: list[Trajectory] = []
        for lo in range(0, len(jobs), len(envs)):
            chunk = jobs[lo : lo + len(envs)]
            played += self.oracle.rollout(
                envs[: len(chunk)],
                [index for _, index in chunk],
                [group for group, _ in chunk],
                seed=self.config.run.seed * 1_000_003 + self.run.step,
            )
        return [t for t in played if self.usable(t)], len(played)

    def evidence_point(self, episode: Trajectory, env: Any) -> int | None:
        """How many actions `episode` had taken when its searches had returned every gold title of its question (the
        first such search); None when that never happened while the episode went on.

        Replays the episode's actions through `env` (searches only cost retrieval) and reads the titles of the
        passages each observation shows (`agents.oracle.shown_passages`), as the env's evidence recall counts them.
        """
        from agents.oracle import shown_passages
        from envs.rewards import title_recall

        if not episode.search_ends or float(episode.info.get("recall", 1.0)) < 1.0:
            return None
        gold = env.unwrapped.examples[episode.example_index].gold_titles
        env.reset(options={"index": episode.example_index})
        seen: set[str] = set()
        for count, action in enumerate(episode.actions[: episode.search_ends[-1]], start=1):
            obs, _, terminated, truncated, _ = env.step(action)
            seen.update(title for title, _ in shown_passages(obs))
            if count in episode.search_ends and title_recall(seen, gold) == 1.0:
                return count
            if terminated or truncated:
                break
        return None

    def expand(self, trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], dict[str, float]]:
        """Grounded expansion: each group's best sampled episode that gathered all its evidence is replayed up to
        that point (`evidence_point`) and the policy samples the rest once more; a continuation whose reward beats
        the group's worst episode replaces it.

        The best is the highest-reward episode among the group's that had every gold title in view with turns
        left (the first on a tie); the continuation replays its turns (same tokens and log-probs, the env steps
        through them again: `ContextAgent.rollout`'s ``scripts``) and is an on-policy episode of the same step, so
        it trains like any. Returns the episodes (the replaced ones swapped in place) and the counts that
        `collect_rollouts` logs as ``expansion/*``.
        """
        envs = self.run.collector.envs
        groups: dict[int, list[int]] = {}
        for i, t in enumerate(trajectories):
            groups.setdefault(t.group_id, []).append(i)
        starts: list[tuple[int, int, int]] = []  # (group, best, actions replayed)
        for group, rows in groups.items():
            points = {i: self.evidence_point(trajectories[i], envs[0]) for i in rows}
            ready = [i for i in rows if points[i] is not None]
            if ready:
                best = max(ready, key=lambda i: trajectories[i].reward)  # the first of the best on a tie
                starts.append((group, best, int(points[best])))
        out = list(trajectories)
        replaced, gain = 0, 0.0
        for lo in range(0, len(starts), len(envs)):
            chunk = starts[lo : lo + len(envs)]
            with self.autocast():  # as the rollouts sampled
                played = self.run.agent.rollout(
                    envs[: len(chunk)],
                    [trajectories[best].example_index for _, best, _ in chunk],
                    [group for group, _, _ in chunk],
                    seed=self.config.run.seed * 1_000_003 + self.run.step + 104_729,
                    members=[self.config.rl.group_size] * len(chunk),  # a sampling stream none of the group's used
                    scripts=[trajectories[best].turns[:count] for _, best, count in chunk],
                )
            for (group, _, _), continuation in zip(chunk, played, strict=True):
                worst = min(groups[group], key=lambda i: out[i].reward)
                if continuation.reward > out[worst].reward:
                    gain += continuation.reward - out[worst].reward
                    out[worst] = continuation
                    replaced += 1
        counts = {"expansion_groups": float(len(starts)), "expansion_replaced": float(replaced), "expansion_gain": gain}
        return out, counts

    def usable(self, episode: Trajectory) -> bool:
        """Whether an oracle episode may join its group: it answered (F1 > 0) from evidence it was shown, and each
        of its contexts fits the model's."""
        info = episode.info
        return (
            float(info.get("f1", 0.0)) > 0
            and bool(info.get("oracle_grounded", False))
            and all(len(g.token_ids) <= self.max_context for g in episode.generations)
        )

    # --- the step ------------------------------------------------------------------------------------------
    def batch_episodes(self, trajectories: Sequence[Trajectory], metrics: dict[str, float]) -> list[Trajectory]:
        """The sampled episodes (expanded with ``--grounded-expansion``) and their groups' expert members."""
        self._expansion = {"expansion_groups": 0.0, "expansion_replaced": 0.0, "expansion_gain": 0.0}
        if self.config.grounded_expansion:
            start = time.perf_counter()
            with self.run.sampler.uncounted():  # time/generation stays the rollouts'
                trajectories, self._expansion = self.expand(trajectories)
            metrics["time/expansion"] = time.perf_counter() - start
        start = time.perf_counter()
        experts, self._played = self.expert_episodes(trajectories)
        metrics["time/experts"] = time.perf_counter() - start
        self._sampled = len(trajectories)
        return [*trajectories, *experts]

    def collate(self, episodes: Sequence[Trajectory]) -> TensorDict:
        """The shared collation, each row marked ``expert``."""
        batch = super().collate(episodes)
        is_expert = torch.arange(len(episodes)) >= self._sampled  # (B,)
        batch["expert"] = is_expert[batch["episode_id"]]  # (N,)
        return batch

    def score_rows(self, batch: TensorDict) -> torch.Tensor:
        """The sampled rows only: an expert has no sampler to compare with."""
        return torch.nonzero(~batch["expert"]).squeeze(-1)  # (n,)

    def observe_advantages(self, episodes: Sequence[Trajectory], batch: TensorDict, adv: Advantages) -> None:
        """The experts' counts, summed over the ranks in `collect_rollouts`."""
        is_expert = torch.arange(len(episodes)) >= self._sampled  # (B,)
        rewards = torch.tensor([t.reward for t in episodes], dtype=torch.float32)  # (B,)
        sampled = episodes[: self._sampled]
        self._expert_counts = {
            "groups": float(len({t.group_id for t in sampled})),
            "groups_with_expert": float(len({t.group_id for t in episodes[self._sampled :]})),
            "members": float(len(episodes) - self._sampled),
            "played": float(self._played),
            "advantage_sum": float(adv.values[is_expert].sum()),
            "reward_sum": float(rewards[is_expert].sum()),
            "untied": float(not rewards_tied(episodes)),
            **self._expansion,
        }

    def collect_rollouts(self) -> Rollouts:
        """The shared first half of the step, with the entropy estimate over the sampled tokens only, the tie test
        over the groups with their experts, and the experts' counts over every rank (`EXPERT_METRICS`)."""
        rollouts = super().collect_rollouts()
        batch = rollouts.batch
        sampled = batch["loss_mask"] & ~batch["expert"].unsqueeze(-1)  # (N, T-1)
        rl_entropy = distributed.token_mean(float(entropy_estimate(batch["old_logp"], sampled)), float(sampled.sum()))
        names = sorted(self._expert_counts)
        totals = dict(zip(names, distributed.all_sum(*(self._expert_counts[k] for k in names)), strict=True))
        self.last_step_tied = totals["untied"] == 0  # data parallel: every rank's groups
        members = totals["members"]
        nan = float("nan")
        expert_metrics = {
            "expert/group_share": totals["groups_with_expert"] / max(totals["groups"], 1.0),
            "expert/members": members,
            "expert/skipped_share": 1.0 - members / totals["played"] if totals["played"] else nan,
            "expert/advantage_mean": totals["advantage_sum"] / members if members else nan,
            "expert/reward_mean": totals["reward_sum"] / members if members else nan,
        }
        if self.config.grounded_expansion:
            groups, replaced = max(totals["groups"], 1.0), totals["expansion_replaced"]
            expert_metrics.update(
                {
                    "expansion/group_share": totals["expansion_groups"] / groups,
                    "expansion/replaced_share": replaced / groups,
                    "expansion/reward_gain": totals["expansion_gain"] / replaced if replaced else nan,
                }
            )
        return dataclasses.replace(
            rollouts, rl_entropy=rl_entropy, batch_metrics={**rollouts.batch_metrics, **expert_metrics}
        )

    def rl_loss_terms(self, part: TensorDict, scale: LossScale) -> TensorDict:
        """``loss_pg`` on the sampled tokens, ``loss_expert`` on the expert tokens (and ``loss_kl`` on the sampled).

        Per-token metrics come back as sums over their own tokens divided by the micro-batch's token count, so the
        shared backward's token-weighted average makes them shares of every token run; `accumulate_gradients` turns
        them back into means over their own tokens.
        """
        cfg = self.config
        mask = part["loss_mask"]  # (n, L-1)
        expert_rows = part["expert"].unsqueeze(-1)  # (n, 1)
        sampled, expert = mask & ~expert_rows, mask & expert_rows  # (n, L-1) each
        logp, _ = self._logprobs(self.run.policy, part, temperature=cfg.rl.temperature)  # (n, L-1)
        terms = self.pg_terms(part, logp, sampled, scale)
        shaped = shaped_expert_loss(logp, part["adv"], expert, cfg.expert_shaping, num_tokens=scale.all_tokens)
        terms["loss_expert"] = shaped["loss_expert"]
        n_all = float(mask.sum()) or 1.0
        sampled_share, expert_share = float(sampled.sum()) / n_all, float(expert.sum()) / n_all
        terms["clip_fraction"] = terms["clip_fraction"] * sampled_share
        terms["approx_kl"] = terms["approx_kl"] * sampled_share
        terms["expert_tokens"] = torch.tensor(expert_share)
        terms["expert_shaped_ratio"] = shaped["shaped_ratio"] * expert_share
        terms["expert_prob"] = shaped["prob"] * expert_share
        loss_kl = self.kl_loss(part, logp, sampled, scale.all_tokens)  # the sampled tokens only
        if loss_kl is not None:
            terms["loss_kl"] = loss_kl
        return terms

    def accumulate_gradients(
        self, batch: TensorDict, sft_batch: TensorDict | None = None, sft_weight: float = 0.0
    ) -> dict[str, float]:
        """The shared gradients of `batch` (`rl_loss_terms`), with the per-token metrics as means over their tokens:
        ``rl/clip_fraction`` and ``rl/approx_kl`` over the sampled tokens, ``expert/*`` over the expert tokens."""
        metrics = super().accumulate_gradients(batch, sft_batch, sft_weight)
        share = metrics.pop("rl/expert_tokens", 0.0)
        for key in ("rl/clip_fraction", "rl/approx_kl"):
            if key in metrics:
                metrics[key] = metrics[key] / (1.0 - share) if share < 1.0 else float("nan")
        shaped, prob = metrics.pop("rl/expert_shaped_ratio", 0.0), metrics.pop("rl/expert_prob", 0.0)
        metrics["expert/token_share"] = share
        metrics["expert/shaped_ratio_mean"] = shaped / share if share else float("nan")
        metrics["expert/prob_mean"] = prob / share if share else float("nan")
        return metrics
