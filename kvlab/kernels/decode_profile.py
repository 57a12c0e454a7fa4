"""The one-call C decode's time split per layer kind (kvlab.kernels._qk.decode_profile*).

While enabled, each decode_layers call adds the calling thread's wall time around every
layer's stages to the stage's kind: attention (latent and gated attention too), a recurrent
mixer (short convolution, Gated DeltaNet, Mamba-2), the MLP or experts, and the layer's tail
(Gemma 4's per-layer input); the whole call is summed too, so what lies between the stages
(the call's buffers) is its remainder. Steps that take the per-op path are not counted. The
timers sit around the stages, not inside the kernels: off, a call tests one flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.kernels.ops import _qk

KINDS = ("attention", "recurrent", "mlp", "tail")  # the C side's KV_PROF_* order


@dataclass(frozen=True)
class DecodeProfile:
    calls: int  # decode_layers calls summed (one per decode step)
    seconds: dict[str, float]  # per kind of KINDS, over all calls
    call_seconds: float  # the calls' whole wall time: the kinds plus what lies between

    def per_call_ms(self) -> dict[str, float]:
        """Each kind's milliseconds per call (0 for all where no call was counted)."""
        return {k: 1e3 * s / self.calls if self.calls else 0.0 for k, s in self.seconds.items()}

    def since(self, before: DecodeProfile) -> DecodeProfile:
        """What was counted after `before` was read."""
        return DecodeProfile(self.calls - before.calls,
                             {k: s - before.seconds[k] for k, s in self.seconds.items()},
                             self.call_seconds - before.call_seconds)


def available() -> bool:
    """Whether the C extension (and so the profile) is built."""
    return _qk is not None


def _need() -> None:
    if _qk is None:
        raise RuntimeError("the decode profile needs the C extension: build it with "
                           "`python setup.py build_ext --inplace`")


def enable(on: bool = True) -> None:
    """Start (or with False stop) timing decode_layers' stages; the sums are kept."""
    _need()
    _qk.decode_profile(on)


def reset() -> None:
    """The sums and the call count back to 0."""
    _need()
    _qk.decode_profile_reset()


def read() -> DecodeProfile:
    _need()
    calls, *kinds, call = _qk.decode_profile_read()
    return DecodeProfile(calls, {k: ns / 1e9 for k, ns in zip(KINDS, kinds)}, call / 1e9)
