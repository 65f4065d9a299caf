"""Data-parallel training on several processes: CPU processes (gloo) or one GPU per process (NCCL).

Launched by `matryoshka2d train --processes N` (N processes on this machine) or by torchrun
(`torchrun --nproc-per-node N -m matryoshka2d.cli train ...`, several machines included).

Each process encodes its share of every batch. The pooled embeddings are then gathered so that every process
computes the loss of the whole batch: in-batch negatives, ESE's PCA target and the KL between layers see all
rows, exactly as in one process (sentence-transformers' `gather_across_devices` and open_clip's full gather do
the same for in-batch negatives). A process's own rows keep their autograd graph; the other processes' rows come
in as constants. The gradient of the whole-batch loss is then the sum, over processes, of what each one got
through its own rows: one all-reduce (sum) of the encoder's gradients per step. The loss's own parameters (the
softmax head) see the whole batch in every process already and are not reduced. Every process starts from rank
0's weights and takes the same optimizer step, so the weights stay identical without further messages.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import numpy as np
import torch


def _on_gpu(device: str | None) -> bool:
    """Where the encoder will run: --device as given, or a GPU when there is one (ElasticEncoder's default)."""
    return str(device).startswith("cuda") if device is not None else torch.cuda.is_available()


@dataclass(frozen=True)
class Processes:
    """This process's place in the run: `world` processes, this one `rank` (0 writes logs, checkpoints, the model)."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @classmethod
    def from_env(cls, device: str | None) -> Processes:
        """The run torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK); one process without it."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        on_gpu = _on_gpu(device)
        if on_gpu:
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if on_gpu else "gloo")
        return cls(world, rank, local)

    def device(self, device: str | None) -> str | None:
        """One GPU per process: `cuda` (or no --device on a machine with a GPU) becomes `cuda:LOCAL_RANK`."""
        if self.active and _on_gpu(device) and device in (None, "cuda"):
            return f"cuda:{self.local_rank}"
        return device

    def share(self, rows: int) -> list[int]:
        """How many of a batch's `rows` each process encodes: contiguous parts, in rank order."""
        return [len(part) for part in np.array_split(np.arange(rows), self.world)]

    def own_rows(self, indices: np.ndarray) -> np.ndarray:
        """This process's rows of a batch; a process whose part is empty encodes the batch's first row as a
        stand-in (dropped after the gather), so every process runs the same collective calls."""
        counts = self.share(len(indices))
        start = sum(counts[: self.rank])
        mine = indices[start : start + counts[self.rank]]
        return mine if len(mine) else indices[:1]

    def gather_rows(self, local: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
        """The whole batch along `dim` from every process's part; only this process's part carries gradient."""
        import torch.distributed as dist

        counts = self.share(rows)
        width = max(counts)
        padded = local.detach()
        if padded.shape[dim] < width:
            shape = list(padded.shape)
            shape[dim] = width - padded.shape[dim]
            padded = torch.cat([padded, padded.new_zeros(shape)], dim)
        padded = padded.contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        pieces = [
            (local if r == self.rank else parts[r]).narrow(dim, 0, counts[r]) for r in range(self.world) if counts[r]
        ]
        return torch.cat(pieces, dim)

    def sum_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Add up the gradients of the shared weights over the processes (one message for all of them)."""
        import torch.distributed as dist

        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def broadcast_from_main(self, modules: list[torch.nn.Module]) -> None:
        """Every process starts from rank 0's weights and buffers (random heads, LoRA adapters included)."""
        import torch.distributed as dist

        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, 0)

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.active:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def without_option(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag VALUE` / `flag=VALUE`."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        elif not item.startswith(flag + "="):
            out.append(item)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(entry, argv: list[str], rank: int, world: int, port: int) -> None:
    """One process of the run: the environment torchrun would give it, then the command itself (`entry(argv)`,
    the command line's main function, passed in so that training never imports the command line)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of every process taking them all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    sys.exit(entry(argv))


def launch(entry, argv: list[str], processes: int) -> int:
    """Run `entry(ARGV)` (the `matryoshka2d` command's main) in `processes` processes on this machine (a
    process group over localhost, as torchrun's standalone mode sets up). If one process fails, the others are
    stopped: they would wait for it forever. The exit code is the first failure's, else 0."""
    import multiprocessing

    argv = without_option(argv, "--processes")
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads or CUDA state
    port = _free_port()
    workers = [context.Process(target=_worker, args=(entry, argv, rank, processes, port)) for rank in range(processes)]
    print(f"training in {processes} processes (rank 0 writes the log, checkpoints and model)", flush=True)
    for worker in workers:
        worker.start()
    failed = 0
    while any(w.is_alive() for w in workers):
        for worker in workers:
            worker.join(timeout=0.2)
            if worker.exitcode not in (None, 0) and not failed:
                failed = worker.exitcode
                for other in workers:
                    if other.is_alive():
                        other.terminate()
    for worker in workers:
        worker.join()
        if not failed and worker.exitcode:
            failed = worker.exitcode
    return failed if failed > 0 else (1 if failed else 0)
