"""Sleep mode (vLLM's `LLM.sleep` / `wake_up`): free a worker's device memory while it serves nothing.

Level 1 copies the weights to CPU memory; level 2 drops them and reloads them from the checkpoint on wake-up (the
buffers, such as rotary caches, are still copied: they are not in the checkpoint). Opaque tensors derived from the
weights (packed CPU weights) are dropped and made again. The KV cache is freed at both levels and comes back zeroed:
its contents are discarded, so the engine resets its prefix cache first. Storages are resized in place (to 0 bytes,
then back), so every tensor and view of them stays valid; their addresses change, so CUDA graphs are dropped and
captured again on wake-up.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol, cast

import torch

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")


class RederivesWeights(Protocol):
    """A layer holding opaque copies of its weights (cpu_gemm's packed ones), which it makes after loading."""

    def process_weights_after_loading(self) -> None: ...


@dataclass
class SleptStorage:
    storage: torch.UntypedStorage
    nbytes: int
    cpu_copy: torch.UntypedStorage | None  # None: restored by other means (reloaded, or zeroed)


def unique_storages(tensors: Iterable[torch.Tensor], exclude: Collection[int] = ()) -> list[torch.UntypedStorage]:
    """The distinct, non-empty storages behind `tensors` (tied weights and views share one), minus `exclude`
    (storage data pointers)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if storage.nbytes() and pointer not in exclude:
            seen.setdefault(pointer, storage)
    return list(seen.values())


def offload(storages: list[torch.UntypedStorage], keep: bool) -> list[SleptStorage]:
    """Free each storage's memory, first copying it to CPU memory when `keep` (pinned on CUDA, for fast copies)."""
    slept = []
    for storage in storages:
        cpu_copy = None
        if keep:
            cpu_copy = torch.UntypedStorage(storage.nbytes(), device="cpu")
            if storage.device.type == "cuda":
                cpu_copy = cpu_copy.pin_memory()
            cpu_copy.copy_(storage)
        slept.append(SleptStorage(storage, storage.nbytes(), cpu_copy))
        storage.resize_(0)
    return slept


def restore(slept: list[SleptStorage]) -> None:
    """Give each storage its memory back, with its CPU copy's contents where it has one."""
    for item in slept:
        item.storage.resize_(item.nbytes)
        if item.cpu_copy is not None:
            item.storage.copy_(item.cpu_copy)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the distinct storages behind `tensors` hold now (0 for freed ones)."""
    return sum(storage.nbytes() for storage in unique_storages(tensors))


class SleepMode:
    """One runner's sleep and wake_up (see the module docstring): the model and its KV cache tensors, and how to
    reload the weights from the checkpoint (level 2)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], reload_weights: Callable[[], None]
                 ) -> None:
        self.model, self.kv_caches, self.reload_weights = model, kv_caches, reload_weights
        self.device = next(model.parameters()).device
        self.slept_weights: list[SleptStorage] | None = None
        self.slept_buffers: list[SleptStorage] | None = None
        self.slept_kv_cache: list[SleptStorage] | None = None
        self.sleep_level = 0
        self.rederive: list[RederivesWeights] = []

    def is_sleeping(self) -> bool:
        return self.slept_weights is not None or self.slept_kv_cache is not None

    def weight_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(parameters, every other plain tensor the modules hold: buffers, say), without the KV cache."""
        params: list[torch.Tensor] = list(self.model.parameters())
        others = [t for module in self.model.modules() for t in vars(module).values()
                  if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)]
        return params, [t for t in [*self.model.buffers(), *others] if t.layout == torch.strided]

    def _drop_derived(self) -> None:
        """Drop the opaque tensors derived from the weights (packed CPU weights), which have no storage to free:
        process_weights_after_loading makes them again."""
        self.rederive = []
        for module in self.model.modules():
            names = [name for name, value in vars(module).items()
                     if isinstance(value, torch.Tensor) and value.layout != torch.strided]
            for name in names:
                setattr(module, name, None)
            if names:
                self.rederive.append(cast(RederivesWeights, module))

    def device_bytes(self) -> dict[str, int]:
        """Bytes the weights and the KV cache hold now, from their storages."""
        params, others = self.weight_tensors()
        kv_pointers = {t.untyped_storage().data_ptr() for t in self.kv_caches} - {0}
        weights = unique_storages([*params, *others], exclude=kv_pointers)
        return {"weights": sum(s.nbytes() for s in weights), "kv_cache": storage_bytes(self.kv_caches)}

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache and offload (level 1) or drop (level 2) the weights; returns the bytes freed."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload the weights to CPU) or 2 (drop them), got {level}")
        before = sum(self.device_bytes().values())
        if self.slept_kv_cache is None:
            self.slept_kv_cache = offload(unique_storages(self.kv_caches), keep=False)
        if self.slept_weights is None:
            params, others = self.weight_tensors()
            kv_pointers = {item.storage.data_ptr() for item in self.slept_kv_cache}
            param_storages = unique_storages(params)
            param_pointers = {s.data_ptr() for s in param_storages}
            self.slept_buffers = offload(unique_storages(others, exclude=param_pointers | kv_pointers), keep=True)
            self.slept_weights = offload(param_storages, keep=level == 1)
            self._drop_derived()
            self.sleep_level = level
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        freed = before - sum(self.device_bytes().values())
        logger.info("sleep level %d: freed %.1f MiB of weights and KV cache", level, freed / (1 << 20))
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the weights and/or the KV cache (all when `tags` is None)."""
        wanted = set(SLEEP_TAGS if tags is None else tags)
        unknown = wanted - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got {sorted(unknown)}")
        if "weights" in wanted and self.slept_weights is not None:
            assert self.slept_buffers is not None
            restore(self.slept_weights)
            if self.sleep_level == 2:
                self.reload_weights()
            restore(self.slept_buffers)
            for module in self.rederive:
                module.process_weights_after_loading()
            self.slept_weights = self.slept_buffers = None
        if "kv_cache" in wanted and self.slept_kv_cache is not None:
            restore(self.slept_kv_cache)
            for kv_cache in self.kv_caches:
                kv_cache.zero_()
            self.slept_kv_cache = None
