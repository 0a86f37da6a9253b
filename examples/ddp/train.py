"""A tiny CPU DDP job: every worker all-reduces a tensor and trains one step of a DDP model.

Launch it with torchrun directly, or through the ``dist.ddp`` component::

    torchrun --nnodes 1 --nproc_per_node 2 examples/ddp/train.py
    asynctorchx run -s local_cwd dist.ddp -j 2x2 --script examples/ddp/train.py

The process group is initialised from the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) with the ``gloo`` backend, so no GPU is needed. The script exits
non-zero when a collective returns a wrong result.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    """Checks an all-reduce and a DDP step; returns the exit code."""
    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("GROUP_RANK", "?")
    local_rank = os.environ.get("LOCAL_RANK", "?")

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    expected = world_size * (world_size + 1) / 2
    print(
        f"rank {rank}/{world_size} (node {node}, local rank {local_rank}): "
        f"all_reduce sum = {value.item():g}, expected {expected:g}",
        flush=True,
    )
    ok = value.item() == expected

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.full((8, 4), float(rank))
    model(inputs).sum().backward()
    optimizer.step()
    weights = model.module.weight.detach().clone()
    gathered = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(gathered, weights)
    in_sync = all(torch.equal(weights, other) for other in gathered)
    print(f"rank {rank}: DDP step done, replicas in sync = {in_sync}", flush=True)
    ok = ok and in_sync

    # Free DDP (its reducer holds the process group) before tearing the group down: destroying
    # the group first lets a worker abort at exit ("terminate called without an active exception").
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    if not ok:
        print(f"rank {rank}: FAILED", file=sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
