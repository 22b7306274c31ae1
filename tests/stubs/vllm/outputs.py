"""`vllm.outputs` of the recording stand-in."""

from types import SimpleNamespace


class RequestOutput(SimpleNamespace):
    """One request's result: ``outputs[0]`` holds token_ids, logprobs, text and finish_reason."""
