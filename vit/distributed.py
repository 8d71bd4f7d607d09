"""Data-parallel training under torchrun: DDP or FSDP2 (``torch.distributed.fsdp.fully_shard``),
gloo on the CPU and NCCL on CUDA.

Every process holds the whole (in-memory) dataset and builds the same global batch of
``--batch-size`` images; process ``r`` of ``W`` trains on rows ``r, r + W, ...`` of it. Each process
scales its summed loss by ``W / global batch``, and DDP / FSDP average gradients over processes,
so a step on W processes is the step one process takes on the whole global batch.

Checkpoints hold full (gathered) state dicts through ``torch.distributed.checkpoint.state_dict``,
written by rank 0: the same files as a single-process run, so a run can be resumed with any number
of processes, or none.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

MODES = ("none", "ddp", "fsdp")
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class PeerLost(RuntimeError):
    """Another process of the job stopped (killed, crashed or timed out)."""


@dataclass
class Context:
    mode: str = "none"
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def setup(mode: str, device_name: str, timeout_seconds: float) -> tuple[Context, torch.device]:
    """Join the process group (``mode`` ddp|fsdp, launched by torchrun) and pick this process's
    device: ``cuda:LOCAL_RANK`` with NCCL when CUDA is asked for or available, else the CPU with gloo."""
    if mode == "none":
        return Context(), _device(device_name, 0)
    if not launched_by_torchrun():
        raise SystemExit(
            f"--distributed {mode} needs torchrun: torchrun --nproc_per_node N -m vit.train ... --distributed {mode}"
        )
    context = Context(
        mode, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    )
    device = _device(device_name, context.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_seconds),
        device_id=device if device.type == "cuda" else None,
    )
    return context, device


def _device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def wrap(model: nn.Module, context: Context, device: torch.device) -> nn.Module:
    """The module to train: ``model`` itself, wrapped in DDP, or sharded by FSDP2 (each block,
    then the root; in place)."""
    if context.mode == "ddp":
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if context.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (context.world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def shard(batch: torch.Tensor, context: Context) -> torch.Tensor:
    """This process's rows of a global batch (N, ...) -> (about N / W, ...)."""
    return batch[context.rank :: context.world] if context.active else batch


def is_peer_failure(error: BaseException, context: Context) -> bool:
    """Whether ``error`` says another process is gone or a collective timed out."""
    if not context.active:
        return False
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def _collective(function, *args, **kwargs):
    try:
        return function(*args, **kwargs)
    except (RuntimeError, dist.DistError) as error:
        raise PeerLost(str(error).splitlines()[0] if str(error) else type(error).__name__) from error


def all_sum(values: torch.Tensor, context: Context) -> torch.Tensor:
    """Sum a tensor over processes (identity when not distributed)."""
    if context.active:
        values = values.clone()
        _collective(dist.all_reduce, values)
    return values


def any_true(flag: bool, context: Context, device: torch.device) -> bool:
    """Whether ``flag`` is true on any process: all stop at the same step."""
    if not context.active:
        return flag
    return bool(all_sum(torch.tensor([float(flag)], device=device), context).item() > 0)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, context: Context) -> tuple[dict, dict]:
    """Full model and optimizer state dicts (keyed by parameter name, on the CPU); under FSDP every
    process must call this (it gathers)."""
    options = _FULL if context.active else StateDictOptions()
    model_state = _collective(get_model_state_dict, model, options=options)
    optimizer_state = _collective(get_optimizer_state_dict, model, optimizer, options=options)
    return model_state, optimizer_state


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict,
    optimizer_state: dict,
    context: Context,
) -> None:
    """Load full state dicts (as :func:`full_state` returns) into a plain, DDP or FSDP2 model; every
    process passes the same full dicts."""
    options = (
        StateDictOptions(full_state_dict=True, strict=True)
        if context.active
        else StateDictOptions(strict=True)
    )
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def barrier(context: Context) -> None:
    if context.active:
        _collective(dist.barrier)


def teardown(context: Context) -> None:
    if context.active and dist.is_initialized():
        dist.destroy_process_group()
