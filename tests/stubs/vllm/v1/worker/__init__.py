"""`vllm.v1.worker` of the recording stand-in."""
