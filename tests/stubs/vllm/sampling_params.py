"""`vllm.sampling_params` of the recording stand-in."""

from types import SimpleNamespace


class SamplingParams(SimpleNamespace):
    """The request's settings, kept as given (n, max_tokens, temperature, top_p, stop, logprobs, seed, ...)."""
