"""The OpenAI-compatible HTTP surface: wire models, serving logic, the FastAPI app and its metrics."""
