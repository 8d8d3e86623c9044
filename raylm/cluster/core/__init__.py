"""What the engine core schedules with (vLLM's v1/core): the scheduler, requests and their queue, the KV cache
manager and block pool, stop checks, speculative-decoding counts, structured output and reasoning."""
