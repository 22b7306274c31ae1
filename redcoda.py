"""RedCoda as a verifiers taskset, found the way the Environments Hub finds one: verifiers imports a taskset id as a
top-level module, and this distribution's id is ``redcoda``, so ``vf eval redcoda`` and a prime-rl worker in a fresh
process load it by name. Everything here is `envs.frameworks.verifiers_env`'s (the `verifiers` extra); the module is
the one top-level name outside the layers of docs/DESIGN, kept for that contract alone.

    pip install 'redcoda[verifiers]'
    vf.load_environment(vf.resolve_env_config({"taskset": {"id": "redcoda", "env_kwargs": {"split": "dev"}}}))
"""

from envs.frameworks.verifiers_env import LocalChatHarness, RedCodaTaskset, load_environment

__all__ = ["LocalChatHarness", "RedCodaTaskset", "load_environment"]
