"""Fetch the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), into the user cache once per machine; print its path."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster.models.default_gguf import main  # noqa: E402

if __name__ == "__main__":
    main()
