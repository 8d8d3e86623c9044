"""raylm's fused float32 CPU kernels (`runner/csrc/`), built on first use.

torch's C++ extension loader compiles them once per machine (~20 s; needs a C++ compiler and ninja) and caches
the build under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). The build name carries a hash of the
sources, the flags and the CPU's instruction set, because the build targets `-march=native`. Where the build
fails, or with `custom_ops="none"`, every layer keeps its plain-torch path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_enabled = True


def set_enabled(enabled: bool) -> None:
    """The worker's switch (`custom_ops`): False keeps every layer on its plain-torch path."""
    global _enabled
    _enabled = enabled


def is_enabled() -> bool:
    return _enabled


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the `ninja` wheel's binary sits in the venv, which an unactivated
    `.venv/bin/python` does not put there."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@cache
def load() -> ModuleType | None:
    """The compiled kernels, or None (with one warning) when they cannot be built here."""
    from torch.utils.cpp_extension import load as load_extension

    _put_ninja_on_path()
    sources = b"".join(path.read_bytes() for path in sorted(_CSRC.glob("*.[ch]*")))
    digest = hashlib.sha1(sources + " ".join(_CFLAGS).encode() + _cpu_flags().encode()).hexdigest()[:12]
    try:
        # -fopenmp: at::parallel_for is a header template, so it runs threads only when this build has OpenMP
        # (libgomp resolves to the copy torch already loaded).
        return load_extension(name=f"raylm_cpu_kernels_{digest}", sources=[str(_CSRC / "cpu_kernels.cpp")],
                              extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"])
    except Exception as exc:  # no compiler, no ninja, a sandbox without a writable cache, ...
        logger.warning("raylm CPU kernels unavailable, using plain torch ops: %s", exc)
        return None


def ops_for(x: torch.Tensor) -> ModuleType | None:
    """The kernels when they apply to `x` (a float32 CPU tensor, kernels enabled and built), else None."""
    if not _enabled or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return load()
