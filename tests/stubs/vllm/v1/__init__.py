"""`vllm.v1` of the recording stand-in."""
