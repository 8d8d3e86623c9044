"""What model=None means: SmolLM2's GGUF where fetched, else the tiny random-weight model built on first use."""
