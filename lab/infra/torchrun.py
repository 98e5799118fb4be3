"""Several processes under torchrun: grpo.py's run sharded over them.

    torchrun --nproc_per_node 2 -m lab.train --reward pair --out runs/two

Each process plays its share of the prompts (prompt g goes to process g mod N); the metrics' sums
and maxima, the probe monitor's scores and the LoRA gradients are reduced across processes, so N
processes x B/N prompts give the update of one process with B prompts. One GPU per process (nccl),
or the CPU (gloo). lab/train.py's loop calls `start` when WORLD_SIZE > 1 and hands the processes
to its setup.
"""
import math
import os

import torch
import torch.distributed as dist

import pair


class DistProcesses(pair.Processes):
    """pair.Processes across a torch.distributed process group."""

    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def all_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def gather(self, values: list[float], size: int) -> list[float]:
        t = torch.full((size,), float("nan"), dtype=torch.float64, device=self.device)
        t[:len(values)] = torch.tensor(values, dtype=torch.float64)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t)
        return [v for part in parts for v in part.tolist() if not math.isnan(v)]

    def all_reduce_grads(self, params) -> None:
        for p in params:
            dist.all_reduce(p.grad)

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        dist.barrier()
        dist.destroy_process_group()


def start(args) -> DistProcesses:
    """Join torchrun's process group: nccl with one GPU per process, else gloo on the CPU."""
    gpu = torch.cuda.is_available() and not (args.devices or "cuda").startswith("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if gpu else "gloo")
    return DistProcesses(dist.get_rank(), dist.get_world_size(), f"cuda:{local}" if gpu else "cpu")
