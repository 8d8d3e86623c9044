"""Where a request enters in this process: the offline `LLM`, the `raylm` command and the OpenAI HTTP server (vLLM's
entrypoints)."""
