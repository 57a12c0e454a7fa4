"""A model step in flight: launched now, its sampled token ids read by the host one step
later (the engine's async scheduling).

    host:    schedule N+1 | wait N's ids (device) | launch N+1 (ids gathered from N's)
             | read N's ids, emit N | schedule N+2 | ...
    device:  ... forward + sample N | forward + sample N+1 | ...

The next step's input ids are gathered from the sampled-id tensor on the device, so the
host never has to know them before it launches that step. How a step overlaps the host's
work differs by device:
  - CUDA: kernels are queued on the stream (of the engine's device, made current while a
    step is launched: Triton launches on the current device); the sampling result (ids and
    any logprobs) is copied to pinned host memory without blocking and an event says when
    it has landed, so reading it never waits for the step launched after it.
  - CPU: the step (inputs, forward, sampling) runs on one worker thread; torch's ops and the
    C kernels release the GIL, so the main thread emits the last step's tokens and
    schedules the next one meanwhile. A step of fewer than CPU_OVERLAP_MIN_ROWS rows runs
    inline instead: the host work it would hide (tens of microseconds a row) is then no
    more than the two thread wake-ups a hand-off costs (on a 2-core VM, a 1-row step of
    a tiny model took 0.18 ms inline and 0.33 ms handed off: bench/host_step.py --loop
    engine).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvlab.sampler import SampleResult
from kvlab.scheduler import SchedulerOutput, Sequence

CPU_OVERLAP_MIN_ROWS = 16  # rows from which a CPU step is handed to the worker thread


@dataclass(eq=False)
class InFlight:
    """One launched step: its schedule, the sequences of its sampled rows (in row order),
    and its sampling result once the device (or the worker) has made it."""

    sched: SchedulerOutput
    seqs: list[Sequence]
    _result: Future[SampleResult]
    _host: SampleResult | None = None  # CUDA: pinned copies, filled without blocking
    _landed: torch.cuda.Event | None = None  # recorded after those copies

    def sampled(self) -> SampleResult:
        """The step's sampling result; its tensors may still be on the device (waits for a
        CPU worker to finish the step)."""
        return self._result.result()

    def host(self) -> SampleResult:
        """The sampling result with its ids on the host (and its logprob columns, where a
        row wants them): the one point where the host waits for it."""
        if self._landed is None:
            return self.sampled()
        self._landed.synchronize()
        assert self._host is not None
        return self._host

    def token_list(self) -> list[int]:
        """The sampled ids as Python ints."""
        return self.host().token_list

    def wait(self) -> None:
        """Return once the step no longer runs (the runner is free for other work)."""
        self._result.result()
        if self._landed is not None:
            self._landed.synchronize()


class StepLauncher:
    """Launches steps so that they overlap the host's work (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._worker: ThreadPoolExecutor | None = None
        if device.type == "cpu":
            threads = torch.get_num_threads()  # OpenMP's thread count is per thread
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvlab-step",
                                              initializer=torch.set_num_threads,
                                              initargs=(threads,))

    def launch(self, sched: SchedulerOutput, seqs: list[Sequence],
               run: Callable[[], SampleResult], logprobs: bool = False) -> InFlight:
        """Start run() (the step's forward and sampling) and return at once. logprobs: some
        row wants them (on CUDA they are then copied to the host with the ids)."""
        if self._worker is not None and len(seqs) >= CPU_OVERLAP_MIN_ROWS:
            return InFlight(sched, seqs, self._worker.submit(run))
        done: Future[SampleResult] = Future()
        if self.device.type != "cuda":
            done.set_result(run())
            return InFlight(sched, seqs, done)
        with torch.cuda.device(self.device):
            result = run()  # queued on the stream: returns before the device has finished
            # the logprob columns stay on the device where no row reads them
            lps = (result.logprobs, result.top_ids, result.top_logprobs)
            host = SampleResult(_pinned_copy(result.token_ids),
                                *(map(_pinned_copy, lps) if logprobs else lps))
            landed = torch.cuda.Event()
            landed.record()
        done.set_result(result)
        return InFlight(sched, seqs, done, host, landed)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that t (on the device) is copied into once the stream gets there."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
