"""Model definitions, the architecture registry and the safetensors loader."""
