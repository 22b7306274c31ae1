"""`vllm.inputs` of the recording stand-in: a `TokensPrompt` is a dict, as vLLM's TypedDict is."""

TokensPrompt = dict
