"""Build the tiny default checkpoint (or a variant): `python scripts/make_tiny_model.py --help`."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raylm.cluster.models.tiny_model import main, make_tiny_model  # noqa: E402

__all__ = ["make_tiny_model", "main"]

if __name__ == "__main__":
    main()
