"""raylm's log lines (stats, start-up layout, per-step traces) show even where nobody configured logging (a CLI run, a
Ray worker or Serve replica), as vLLM's do; where the application configured logging, they go through it."""
from __future__ import annotations

import logging

_FORMAT = logging.Formatter("%(levelname)s %(asctime)s [raylm] %(message)s", "%m-%d %H:%M:%S")


def show_info(target: logging.Logger) -> None:
    """Let `target`'s INFO lines through, to stderr if the root logger has no handler."""
    target.setLevel(logging.INFO)
    if not target.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_FORMAT)
        target.addHandler(handler)
        target.propagate = False
