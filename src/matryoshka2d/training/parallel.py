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

The processes `launch` starts live and die together: SIGTERM or SIGINT to the launcher is passed on to every
worker; a worker dies with its launcher even when the launcher is killed with SIGKILL (Linux's parent-death
signal, and a watchdog thread that notices the parent is gone, for other systems); a worker that dies stops the
others and is named with its cause (a signal or an exit code) instead of the surviving workers' gloo errors.
What a kill leaves behind is what it leaves in one process: the last atomic checkpoint (training/rundir.py).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import sys
import threading
import time
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


PR_SET_PDEATHSIG = 1  # linux/prctl.h
LOST_CONTACT = 3  # a worker's exit code when a collective failed because another process is gone
WATCH_SECONDS = 0.5  # how often a worker's watchdog looks for its launcher
KILL_AFTER_SECONDS = 10.0  # a worker still alive this long after SIGTERM gets SIGKILL


def die_with_parent(parent: int) -> None:
    """Make this process end when `parent` (its launcher) does, even by SIGKILL, which no handler sees: Linux
    sends the parent-death signal (prctl PR_SET_PDEATHSIG, SIGKILL); everywhere a daemon thread exits the process
    once its parent pid changes (the orphan was adopted). A launcher that died before this ran is noticed at once."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl in this libc: the watchdog below still works
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_SECONDS)
        os._exit(1)  # the launcher is gone: nobody would read our results or stop us

    threading.Thread(target=watch, name="matryoshka2d-launcher-watchdog", daemon=True).start()


def _lost_contact(exc: BaseException) -> bool:
    """An error from a collective call because another process of the run is gone (gloo or NCCL)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in ("gloo", "Gloo", "NCCL", "Connection reset"))


def _reason(exc: BaseException) -> str:
    """The gist of a collective's error: '[.../gloo/.../pair.cc:537] Read error [...]: Connection reset by peer.
    This is typically caused by ...' becomes 'Read error [...]: Connection reset by peer'."""
    line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)  # the C++ source location
    return line.split(". ")[0][:160]


def _worker(entry, argv: list[str], rank: int, world: int, port: int, parent: int) -> None:
    """One process of the run: the environment torchrun would give it, then the command itself (`entry(argv)`,
    the command line's main function, passed in so that training never imports the command line)."""
    die_with_parent(parent)
    # Ctrl-C reaches the whole process group; the launcher alone handles it and stops the workers with SIGTERM,
    # whose default action ends a worker at once, even inside a collective call that is waiting for a dead peer.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # tqdm's default lock is a multiprocessing semaphore; a worker killed while holding it registered leaves the
    # resource tracker printing a "leaked semaphore" warning. A thread lock is all one process needs.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of every process taking them all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        code = entry(argv)
    except Exception as exc:
        if not _lost_contact(exc):
            raise
        # The launcher names the process that died; this one only says it lost contact (no gloo traceback).
        print(f"process {rank} of {world}: lost contact with the other processes ({_reason(exc)})", file=sys.stderr)
        sys.stderr.flush()
        os._exit(LOST_CONTACT)
    sys.exit(code)


def exit_cause(code: int) -> str:
    """A multiprocessing exit code in words: a negative code is the signal that ended the process."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == LOST_CONTACT:
        return "lost contact with the other processes"
    return f"exited with code {code}"


def launch(entry, argv: list[str], processes: int) -> int:
    """Run `entry(ARGV)` (the `matryoshka2d` command's main) in `processes` processes on this machine (a
    process group over localhost, as torchrun's standalone mode sets up). If one process fails, the others are
    stopped: they would wait for it forever; the failure is named (which process, which signal or exit code).
    SIGTERM and SIGINT to the launcher stop every worker. The exit code: a worker's own error code (2: a
    message it printed), 1 for a worker killed or crashed, 128 + the signal when the launcher was stopped, else 0."""
    import multiprocessing

    argv = without_option(argv, "--processes")
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads or CUDA state
    port = _free_port()
    parent = os.getpid()
    workers = [
        context.Process(target=_worker, args=(entry, argv, rank, processes, port, parent)) for rank in range(processes)
    ]
    stopped_by: list[int] = []  # the signal the launcher got, if any
    ours: set[int] = set()  # workers this launcher stopped (their SIGTERM is not a cause)
    stopping_since: list[float] = []

    def stop_all() -> None:
        if not stopping_since:
            stopping_since.append(time.monotonic())
        for worker in workers:
            if worker.pid is not None and worker.is_alive():
                ours.add(worker.pid)
                worker.terminate()

    def forward(signum, _frame) -> None:
        stopped_by.append(signum)
        stop_all()

    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        previous = {s: signal.signal(s, forward) for s in handled}
    try:
        print(f"training in {processes} processes (rank 0 writes the log, checkpoints and model)", flush=True)
        # SIGINT blocked while the workers start: a started worker inherits the mask, so a Ctrl-C to the process
        # group before it sets SIG_IGN (in _worker) cannot end it mid-import with a traceback; the launcher takes
        # its own pending Ctrl-C once unblocked, and stops the workers.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for worker in workers:
                worker.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if stopped_by:  # a signal arrived while starting: the workers started so far are stopped
            stop_all()
        while any(w.is_alive() for w in workers):
            for worker in workers:
                worker.join(timeout=0.2)
                if worker.exitcode not in (None, 0):
                    stop_all()
            if stopping_since and time.monotonic() - stopping_since[0] > KILL_AFTER_SECONDS:
                for worker in workers:
                    if worker.is_alive():
                        worker.kill()  # SIGTERM did not end it (stuck in the kernel, or a handler)
        for worker in workers:
            worker.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped_by:
        name = signal.Signals(stopped_by[0]).name
        print(f"matryoshka2d train: stopped by {name}; all {processes} processes were stopped", file=sys.stderr)
        return 128 + stopped_by[0]
    failures = [(rank, w) for rank, w in enumerate(workers) if w.exitcode]
    if not failures:
        return 0
    # The cause: a process that failed on its own (not stopped by us, not only cut off from a dead one).
    causes = [(r, w) for r, w in failures if w.pid not in ours and w.exitcode != LOST_CONTACT] or failures
    rank, worker = causes[0]
    if worker.exitcode == 2:  # the command's own error: the worker printed the message
        return 2
    print(
        f"matryoshka2d train: error: process {rank} of {processes} (pid {worker.pid}) {exit_cause(worker.exitcode)}; "
        f"the other processes were stopped",
        file=sys.stderr,
    )
    return 1
