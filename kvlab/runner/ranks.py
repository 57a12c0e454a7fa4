"""Tensor-parallel ranks around the model runner: rank 0 runs the engine (scheduler, sampler)
and hands each step's plan to the other ranks, which run their shard of the model on it.

    start_ranks     the group: N - 1 spawned local workers (a free port on 127.0.0.1), or
                    the ranks torchrun started (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT);
                    on a torchrun rank > 0 it serves rank 0 and exits the process
    LeaderRunner    rank 0's ModelRunner: each call is broadcast before it runs
    follow          a rank > 0: load its shard, build the same runner, run what rank 0 sends

Two groups: the model's all-reduces run on `tp.group` (gloo on CPUs, NCCL on CUDA); the
plans go over a gloo group of their own, whose wait has no practical time limit, since a
follower waits there for as long as the server is idle. A rank that dies closes its sockets,
so the others' next collective fails instead of hanging; rank 0 tells the workers to stop on
close() and at exit, then joins them. Signals wait for the end of a step on rank 0 (Ctrl-C
then stops every rank in a second or two), and spawned workers leave Ctrl-C to rank 0.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlab.errors import KvlabError
from kvlab.kernels import set_num_threads
from kvlab.models.loader import LoadOptions, load_model
from kvlab.models.sharding import TensorParallel
from kvlab.runner.model_runner import ModelRunner, StepLogits
from kvlab.scheduler import SchedulerOutput
from kvlab.weights.checkpoint import open_checkpoint

RENDEZVOUS = timedelta(minutes=5)  # for every rank to join, and for one step's all-reduces
IDLE = timedelta(days=365)  # a follower's wait for the next plan
JOIN_SECONDS = 10.0


@dataclass(frozen=True)
class RankCommand:
    """What rank 0 sends the others: "setup" (the runner's arguments), "step", "reserve"
    (touch the KV pool) or "stop"."""

    op: str
    step: SchedulerOutput | None = None
    record_experts: bool = False
    runner_args: dict[str, Any] | None = None
    tokens: int | None = None  # "reserve": the first slots only (ModelRunner.reserve_kv)


@dataclass
class Ranks:
    """Rank 0's handle on the group: the model's TensorParallel, the plan group, and the
    worker processes it spawned (none under torchrun)."""

    tp: TensorParallel
    plans: Any  # torch.distributed ProcessGroup (gloo)
    workers: list[Any]
    closed: bool = False
    in_step: bool = False  # a step began and did not end: the ranks may be out of step

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step on every rank, with SIGINT and SIGTERM held until it ends: a signal
        taken mid-collective can leave the ranks one collective apart, each waiting on the
        other; held, it is taken between steps, where close() can stop the others."""
        self.in_step = True
        with _signals_held():
            yield
        self.in_step = False

    def send(self, command: RankCommand) -> None:
        dist.broadcast_object_list([command], src=0, group=self.plans)

    def close(self) -> None:
        """Tell the other ranks to stop, join the workers (terminate those that hang)."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.in_step:  # else the others wait in a collective, not for a plan
                self.send(RankCommand("stop"))
        except RuntimeError:
            pass  # a rank already gone: the workers are ended below
        for p in self.workers:
            p.join(0 if self.in_step else JOIN_SECONDS)
            if p.is_alive():
                p.terminate()
                p.join(JOIN_SECONDS)
        dist.destroy_process_group()


def start_ranks(size: int, model_path: str, options: LoadOptions,
                threads: int | None) -> Ranks:
    """The group of `size` ranks with this process as rank 0. Under torchrun (WORLD_SIZE in
    the environment) a rank > 0 never returns: it follows rank 0, then exits the process."""
    if dist.is_initialized():
        raise KvlabError("this process already belongs to a torch.distributed group (another "
                         "tensor-parallel engine?): close that engine first")
    env_size = int(os.environ.get("WORLD_SIZE", "1"))
    if env_size > 1:
        if env_size != size:
            raise KvlabError(f"--tensor-parallel-size {size} but torchrun started "
                             f"{env_size} ranks (WORLD_SIZE); pass the same number")
        return _join_torchrun(size, model_path, options, threads)
    port = _free_port()
    with _signals_held():
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=RENDEZVOUS,
                              wait_for_workers=False)
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_spawned_rank, daemon=True, name=f"kvlab-tp-rank{r}",
                           args=(r, size, port, model_path, options, threads))
               for r in range(1, size)]
    for p in workers:
        p.start()
    try:
        _wait_for_workers(store, workers)
        tp, plans = _init_group(0, size, options.device, store)
    except BaseException:
        for p in workers:
            p.terminate()
        raise
    ranks = Ranks(tp, plans, workers)
    atexit.register(ranks.close)
    return ranks


def _wait_for_workers(store: Any, workers: list[Any]) -> None:
    """Until every spawned rank has reached the store; a rank that exits first (an import
    error, an unguarded main module) fails the start at once instead of at the timeout."""
    deadline = time.monotonic() + RENDEZVOUS.total_seconds()
    keys = [f"kvlab-rank-{r}" for r in range(1, len(workers) + 1)]
    while not store.check(keys):
        dead = [p for p in workers if not p.is_alive()]
        if dead:
            raise KvlabError(f"tensor-parallel worker {dead[0].name} exited with status "
                             f"{dead[0].exitcode} before joining (its error is above; a "
                             "script that starts kvlab needs an "
                             "`if __name__ == \"__main__\":` guard)")
        if time.monotonic() > deadline:
            raise KvlabError(f"tensor-parallel workers did not join within {RENDEZVOUS}")
        time.sleep(0.05)


def _join_torchrun(size: int, model_path: str, options: LoadOptions,
                   threads: int | None) -> Ranks:
    rank = int(os.environ["RANK"])
    tp, plans = _init_group(rank, size, options.device)
    if rank != 0:
        follow(tp, plans, model_path, options, threads)
        sys.exit(0)
    ranks = Ranks(tp, plans, [])
    atexit.register(ranks.close)
    return ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, size: int, device: str,
                store: Any = None) -> tuple[TensorParallel, Any]:
    """Join the default group (through `store`, or torchrun's env:// without one) and make
    the plans' gloo group."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_device(device))
    with _signals_held():  # and so are they in the threads started here
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=RENDEZVOUS, init_method=None if store else "env://")
        plans = dist.new_group(backend="gloo", timeout=IDLE)
    return TensorParallel(rank, size, dist.group.WORLD), plans


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread (and in threads started meanwhile: gloo's
    and the store's I/O threads keep the mask) until the block ends; one that came is then
    delivered. A signal taken inside a socket call can leave the ranks one collective apart."""
    blocked = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def local_device(device: str) -> str:
    """A rank's own device: "cuda" means the GPU of its local rank (LOCAL_RANK, or RANK)."""
    if device != "cuda":
        return device
    return f"cuda:{os.environ.get('LOCAL_RANK', os.environ.get('RANK', '0'))}"


def _spawned_rank(rank: int, size: int, port: int, model_path: str, options: LoadOptions,
                  threads: int | None) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops us
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=RENDEZVOUS)
    store.set(f"kvlab-rank-{rank}", "joined")
    tp, plans = _init_group(rank, size, options.device, store)
    follow(tp, plans, model_path, options, threads)


def follow(tp: TensorParallel, plans: Any, model_path: str, options: LoadOptions,
           threads: int | None) -> None:
    """A rank > 0: load its shard, then run each step rank 0 sends until "stop". An error
    ends the process with its traceback, which closes its sockets: rank 0's next
    collective then fails rather than waits."""
    if threads:
        set_num_threads(threads)
    device = local_device(options.device)
    loaded = load_model(open_checkpoint(model_path), replace(options, device=device), tp)
    runner: ModelRunner | None = None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=plans)
        cmd: RankCommand = box[0]
        if cmd.op == "stop":
            break
        if cmd.op == "setup":
            runner = ModelRunner(loaded.model, loaded.config,
                                 **dict(cmd.runner_args or {}, device=device))
            dist.barrier(group=plans)  # every rank is loaded
        elif cmd.op == "reserve" and runner is not None:
            runner.reserve_kv(cmd.tokens)
        elif cmd.op == "step" and runner is not None:
            runner.execute(cmd.step, cmd.record_experts, logits=False)
    dist.destroy_process_group()


class LeaderRunner(ModelRunner):
    """Rank 0's runner: sends every step (and the KV reserve) to the other ranks first, so
    all ranks run the same step with the same inputs, then runs its own shard."""

    def __init__(self, ranks: Ranks, model: object, config: Any, **kwargs: Any) -> None:
        super().__init__(model, config, **kwargs)
        self.ranks = ranks
        ranks.send(RankCommand("setup", runner_args=kwargs))
        try:
            dist.barrier(group=ranks.plans)
        except RuntimeError as e:
            raise KvlabError("a tensor-parallel rank failed while loading its shard (its "
                             f"error is above): {e}") from None

    def execute(self, out: SchedulerOutput, record_experts: bool = False,
                logits: bool = True, hidden: bool = False) -> StepLogits:
        with self.ranks.step():
            self.ranks.send(RankCommand("step", out, record_experts))
            return super().execute(out, record_experts, logits, hidden)

    def reserve_kv(self, tokens: int | None = None) -> None:
        with self.ranks.step():
            self.ranks.send(RankCommand("reserve", tokens=tokens))
            super().reserve_kv(tokens)

    def close(self) -> None:
        super().close()
        self.ranks.close()
