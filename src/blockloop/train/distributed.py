"""Distributed training from the outside: the model stays single-device code.

``torchrun`` sets RANK/WORLD_SIZE/LOCAL_RANK; :func:`init_distributed` joins the process group (NCCL
on GPUs, gloo on CPU) and :func:`parallelize` wraps the model in DDP, or shards every block and then
the root with FSDP2 for models whose optimizer state does not fit one device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from blockloop.choices import DISTRIBUTED


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> DistInfo:
    """Join the process group when launched by torchrun; a no-op for a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world_size)
    if device.startswith("cuda"):
        # Each rank's own GPU as "cuda": a teacher loaded on "cuda" and the saved CUDA RNG state are this rank's.
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return info


def parallelize(
    model: nn.Module, strategy: str, info: DistInfo, device: torch.device, *, per_layer: bool = True
) -> nn.Module:
    """The model to train: itself alone, DDP-wrapped, or FSDP2-sharded: per block when ``per_layer`` (the
    family's ``shard_per_layer``: no layer weight is used outside its block's forward), else as one unit."""
    if not info.enabled:
        return model
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from blockloop.models.decoder import Block

        for block in [m for m in model.modules() if isinstance(m, Block)] if per_layer else []:
            fully_shard(block)
        fully_shard(model)
        return model
    raise ValueError(f"unknown distributed strategy {strategy!r}; choose one of {DISTRIBUTED}")


def sum_across_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def mean_across_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    return sum_across_ranks(value, info) / info.world_size


def on_any_rank(flag: bool, info: DistInfo) -> bool:
    """Whether ``flag`` holds on some rank. Every rank gets the same answer, so all of them refuse together
    rather than one exiting while the others wait for it in their next collective."""
    if not info.enabled:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return sum_across_ranks(torch.tensor([float(flag)], device=device), info).item() > 0


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
