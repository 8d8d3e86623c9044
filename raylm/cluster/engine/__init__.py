"""The engine (vLLM's v1/engine): the config resolved once, EngineCore stepping the scheduler and executor, LLMEngine
and AsyncLLM around it, output processing and detokenizing, stats, LoRA bookkeeping."""
