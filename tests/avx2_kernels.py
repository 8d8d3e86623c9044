"""raylm's CPU kernels built for AVX2 without AVX-512 (`-march=haswell`), whatever this CPU has beyond that: the
register-width paths that AVX2-only machines run (8-float vectors; the skinny linear's 4-row passes), checked on an
AVX-512 machine too. None where the CPU lacks AVX2 + FMA (it could not run them) or nothing can be built."""
from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType

from raylm.runner import cpu_kernels

_CSRC = Path(cpu_kernels.__file__).with_name("csrc")


@cache
def avx2_kernels() -> ModuleType | None:
    flags = cpu_kernels.cpu_flags().split()
    if not {"avx2", "fma"} <= set(flags):
        return None
    # The last -march wins over the build's -march=native.
    return cpu_kernels.load_extension("cpu_kernels_avx2", sorted(_CSRC.glob("*.[ch]*")), "cpu_kernels.cpp",
                                      "raylm: building the CPU kernels for AVX2 (tests, once per machine)...",
                                      extra_cflags=("-march=haswell",))
