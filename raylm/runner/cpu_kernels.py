"""raylm's fused CPU kernels (`runner/csrc/`), built on first use: the decoder's kernels take float32 or bfloat16
(stored bfloat16, computed float32; the linears' bfloat16 pairs by AVX512-BF16 where the build targets it), the LoRA
product float32 only.

torch's C++ extension loader compiles them once per machine (~20 s; needs a C++ compiler and ninja) into the user
cache (configs.envs.cache_dir: ~/.cache/raylm/cpu_kernels/<key>), keyed by the sources' contents, the flags, the CPU's
instruction set (the build targets `-march=native`), torch and Python, never by where the sources lie: another
checkout, working dir or Ray job reuses the build. Where the build fails, or with `custom_ops="none"`, every layer keeps
its plain-torch path.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import platform
import shutil
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from raylm.configs.cache import build_once, cache_path, content_key

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


def cpu_flags() -> str:
    """The CPU's instruction-set flags: what a build or a measurement done on this machine depends on."""
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
    return load_extension("cpu_kernels", sorted(_CSRC.glob("*.[ch]*")), "cpu_kernels.cpp",
                          "raylm: building the CPU kernels (once per machine, ~20 s)...")


@cache
def load_avx2() -> ModuleType | None:
    """The same kernels built for AVX2 + FMA alone (`-march=haswell`, the last -march winning over -march=native):
    what an AVX2-only CPU runs, for tests and benchmarks on a CPU with more. None where the CPU lacks AVX2 + FMA (it
    could not run them) or nothing can be built."""
    if not {"avx2", "fma"} <= set(cpu_flags().split()):
        return None
    return load_extension("cpu_kernels_avx2", sorted(_CSRC.glob("*.[ch]*")), "cpu_kernels.cpp",
                          "raylm: building the CPU kernels for AVX2 (once per machine)...",
                          extra_cflags=("-march=haswell",))


def load_extension(kind: str, sources: list[Path], main: str, announce: str,
                   extra_cflags: tuple[str, ...] = ()) -> ModuleType | None:
    """Build the extension whose entry point is the source named `main` once per machine into the user cache
    (cache_path(kind, key)), keyed by every source's name and bytes, the flags, the CPU, torch and Python; or None,
    with one warning, where it cannot be built."""
    _put_ninja_on_path()
    cflags = [*_CFLAGS, *extra_cflags]
    key = content_key(*(part for path in sources for part in (path.name, path.read_bytes())), " ".join(cflags),
                      cpu_flags(), torch.__version__, sys.implementation.cache_tag)
    name, folder = f"raylm_{kind}_{key[:12]}", cache_path(kind, key)
    try:
        built = build_once(folder, lambda tmp: _build(name, sources, main, cflags, tmp), announce)
        return built if built is not None else _import(name, folder / f"{name}.so")
    except Exception as exc:  # no compiler, no ninja, a sandbox without a writable cache, ...
        logger.warning("raylm CPU kernels unavailable, using plain torch ops (%s): %s", kind, exc)
        return None


def _build(name: str, sources: list[Path], main: str, cflags: list[str], folder: Path) -> ModuleType:
    """Compile copies of the sources in the (temp) build folder. Later processes import the library straight from
    the cache, so another checkout's paths or file times cannot make ninja rebuild it."""
    from torch.utils.cpp_extension import load as load_extension

    (folder / "src").mkdir()
    for path in sources:
        shutil.copyfile(path, folder / "src" / path.name)
    # -fopenmp: at::parallel_for is a header template, so it runs threads only when this build has OpenMP
    # (libgomp resolves to the copy torch already loaded).
    return load_extension(name=name, sources=[str(folder / "src" / main)], build_directory=str(folder),
                          extra_cflags=cflags, extra_ldflags=["-fopenmp"])


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The dtypes the decoder's kernels (norms, activation, rotary, attention, KV cache, skinny linear, layer stack) take.
DECODER_DTYPES = (torch.float32, torch.bfloat16)


def ops_for(x: torch.Tensor) -> ModuleType | None:
    """The decoder's kernels when they apply to `x` (a float32 or bfloat16 CPU tensor, kernels enabled and built),
    else None."""
    return ops_for_kind(x.device, x.dtype, DECODER_DTYPES)


def ops_for_kind(device: torch.device, dtype: torch.dtype,
                 dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> ModuleType | None:
    """The kernels when they apply to tensors of this device and dtype (one of `dtypes`, on the CPU), else None."""
    if not _enabled or device.type != "cpu" or dtype not in dtypes:
        return None
    return load()
