"""RedCoda environments: multi-hop QA with search, as Gymnasium envs.

Importing this package registers the RedCoda-* ids and does nothing heavy (no JVM, no torch):

    import gymnasium as gym, envs
    env = gym.make("RedCoda-HotpotQA-v0")
    envs.episode_metrics(info)          # a finished episode's metrics, from its terminal info
"""

from gymnasium.envs.registration import register, registry

from envs.data import DataError, QAExample, load_examples
from envs.metrics import EPISODE_METRICS, episode_metrics
from envs.rewards import RewardWeights

ENV_IDS = {
    "RedCoda-HotpotQA-v0": {"dataset": "hotpotqa", "split": "train", "protocol": "flat"},
    "RedCoda-HotpotQA-CoDA-v0": {"dataset": "hotpotqa", "split": "train", "protocol": "coda"},
    "RedCoda-MuSiQue-v0": {"dataset": "musique", "split": "dev", "protocol": "flat"},
    "RedCoda-2Wiki-v0": {"dataset": "2wiki", "split": "dev", "protocol": "flat"},
    "RedCoda-Bamboogle-v0": {"dataset": "bamboogle", "split": "test", "protocol": "flat"},
}
"""Every registered RAGEnv id and the arguments it fixes (others can be passed to gym.make)."""

OTHER_ENV_IDS = {
    "RedCoda-QueryRewrite-v0": "envs.query_rewrite:QueryRewriteEnv",
    "RedCoda-Task-v0": "envs.tasks:TaskEnv",
}
"""Registered ids of the other envs and their entry points. RedCoda-Task-v0 plays the bundled example task; give
it your own with task_file=PATH and trust_code=True (loading a task file runs its code), or task=Task(...).
Every registered id makes with no arguments (`gym.make(id)`)."""

for _env_id, _kwargs in ENV_IDS.items():
    if _env_id not in registry:
        register(id=_env_id, entry_point="envs.rag_env:RAGEnv", kwargs=_kwargs)
for _env_id, _entry_point in OTHER_ENV_IDS.items():
    if _env_id not in registry:
        register(id=_env_id, entry_point=_entry_point)

__all__ = [
    "ENV_IDS",
    "EPISODE_METRICS",
    "OTHER_ENV_IDS",
    "DataError",
    "QAExample",
    "RewardWeights",
    "episode_metrics",
    "load_examples",
]
