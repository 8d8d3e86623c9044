"""Tensor-parallel linear layers. Each parameter carries `weight_loader(param, loaded_weight, shard_id=None)`
which takes the FULL checkpoint tensor and copies in this rank's shard, so sharding happens at load time. A layer's
`quant_method` (vLLM's shape) creates its weight and runs it: float here, packed blocks under a `quantization`."""
from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from raylm.runner.layers.cpu_gemm import CpuGemmMixin
from raylm.runner.layers.quantization.base_config import QuantizeMethodBase, WeightLoader, current_quant_config
from raylm.runner.parallel_state import get_tp_group

if TYPE_CHECKING:
    from raylm.runner.lora.layers import LoRASlots


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    assert shard_id is None, f"unexpected shard {shard_id!r} for an unsharded parameter"
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit parameter "
                         f"of shape {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def set_weight_loader(param: nn.Parameter, weight_loader: WeightLoader) -> nn.Parameter:
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param


def _copy_shard(dst: torch.Tensor, loaded: torch.Tensor, dim: int, shard_rank: int) -> None:
    size = dst.shape[dim]
    assert loaded.shape[dim] >= (shard_rank + 1) * size, f"checkpoint tensor {tuple(loaded.shape)} too small"
    dst.copy_(loaded.narrow(dim, shard_rank * size, size))


class UnquantizedLinearMethod(QuantizeMethodBase):
    """A float weight [out, in] run by the CPU GEMM plans (cpu_gemm) or F.linear."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_size_per_partition: int,
                       weight_loader: WeightLoader) -> None:
        layer.weight = set_weight_loader(nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition),
                                                      requires_grad=False), weight_loader)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(layer, CpuGemmMixin):
            return layer.matmul(x, bias)
        return F.linear(x, cast(torch.Tensor, layer.weight), bias)  # create_weights made it

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, cast(torch.Tensor, layer.weight))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if isinstance(layer, CpuGemmMixin):
            CpuGemmMixin.process_weights_after_loading(layer)

    def kernel_name(self, layer: nn.Module) -> str:
        return CpuGemmMixin.kernel_name(layer) if isinstance(layer, CpuGemmMixin) else "sgemm"


def get_quant_method(layer: nn.Module) -> QuantizeMethodBase:
    """The method the current quantization config gives `layer`, else the unquantized one."""
    config = current_quant_config()
    method = config.get_quant_method(layer) if config is not None else None
    return method or UnquantizedLinearMethod()


class LinearBase(CpuGemmMixin, nn.Module):
    """y = x W^T + b with W of shape [out_features, in_features] on this rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.input_size_per_partition, self.output_size_per_partition = in_features, out_features
        self.quant_method = get_quant_method(self)
        self.quant_method.create_weights(self, in_features, out_features, self.weight_loader)
        self.bias = None
        self.lora: LoRASlots | None = None  # LoRA slots (raylm/runner/lora/layers.py), when LoRA is enabled
        if bias:
            self.bias = set_weight_loader(nn.Parameter(torch.empty(out_features), requires_grad=False),
                                          self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def apply_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def kernel_name(self) -> str:
        return self.quant_method.kernel_name(self)

    def extra_repr(self) -> str:
        return (f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp={self.tp_size}")


class ColumnParallelLinear(LinearBase):
    """W split along the output dimension; each rank computes its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False) -> None:
        tp_size = get_tp_group().world_size
        assert output_size % tp_size == 0, f"output size {output_size} not divisible by tp={tp_size}"
        super().__init__(input_size, output_size // tp_size, bias)
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        assert shard_id is None
        _copy_shard(param.data, loaded_weight, 0, self.tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.apply_linear(x, self.bias)
        if self.lora is not None:
            self.lora.add_to(y, x)
        return get_tp_group().all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one GEMM (gate_up_proj); shard_id i loads output i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        assert all(size % self.tp_size == 0 for size in output_sizes), f"{output_sizes} not divisible by tp"
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:  # a checkpoint that stores the outputs already fused
            starts = accumulate(self.output_sizes, initial=0)
            for i, (start, size) in enumerate(zip(starts, self.output_sizes, strict=False)):
                self.weight_loader(param, loaded_weight.narrow(0, start, size), i)
            return
        assert isinstance(shard_id, int) and 0 <= shard_id < len(self.output_sizes)
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        _copy_shard(param.data.narrow(0, offset, size), loaded_weight, 0, self.tp_rank)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads. With more TP ranks than KV heads, each rank holds one KV head and
    `num_kv_head_replicas` ranks share it."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = False) -> None:
        tp_size = get_tp_group().world_size
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        assert total_num_heads % tp_size == 0, f"{total_num_heads} heads not divisible by tp={tp_size}"
        if tp_size >= total_num_kv_heads:
            assert tp_size % total_num_kv_heads == 0, f"tp={tp_size} not a multiple of {total_num_kv_heads} kv heads"
            num_kv_heads, num_kv_head_replicas = 1, tp_size // total_num_kv_heads
        else:
            assert total_num_kv_heads % tp_size == 0, f"{total_num_kv_heads} kv heads not divisible by tp={tp_size}"
            num_kv_heads, num_kv_head_replicas = total_num_kv_heads // tp_size, 1
        num_heads = total_num_heads // tp_size
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * tp_size * head_size, bias)
        self.num_heads, self.num_kv_heads, self.num_kv_head_replicas = num_heads, num_kv_heads, num_kv_head_replicas
        self.total_num_heads, self.total_num_kv_heads, self.head_size = total_num_heads, total_num_kv_heads, head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id is None:  # a checkpoint that stores qkv already fused
            total_q, total_kv = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
            for sid, (start, size) in zip("qkv", [(0, total_q), (total_q, total_kv), (total_q + total_kv, total_kv)],
                                          strict=True):
                self.weight_loader(param, loaded_weight.narrow(0, start, size), sid)
            return
        offset, size, shard_rank = {
            "q": (0, q_size, self.tp_rank),
            "k": (q_size, kv_size, self.tp_rank // self.num_kv_head_replicas),
            "v": (q_size + kv_size, kv_size, self.tp_rank // self.num_kv_head_replicas),
        }[shard_id]  # type: ignore[index]
        _copy_shard(param.data.narrow(0, offset, size), loaded_weight, 0, shard_rank)


class RowParallelLinear(LinearBase):
    """W split along the input dimension (the input arrives already split); partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True) -> None:
        tp_size = get_tp_group().world_size
        assert input_size % tp_size == 0, f"input size {input_size} not divisible by tp={tp_size}"
        super().__init__(input_size // tp_size, output_size, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        assert shard_id is None
        if param.dim() == 1:  # bias: not split
            default_weight_loader(param, loaded_weight)
        else:
            _copy_shard(param.data, loaded_weight, 1, self.tp_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias joins on one rank only, so the all-reduce adds it once.
        y = self.apply_linear(x, self.bias if self.tp_rank == 0 else None)
        if self.lora is not None:
            self.lora.add_to(y, x)
        return get_tp_group().all_reduce(y) if self.reduce_results else y
