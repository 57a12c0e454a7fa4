"""kvlab: an LLM inference engine that is fast, real, and honest about where every
millisecond goes.

    from kvlab import LLM, SamplingParams
    LLM().generate("The capital of France is", SamplingParams(max_tokens=32))
"""

import os

# kvlab's C kernels run their own worker threads beside torch's OpenMP pool; OpenMP's default
# busy-waiting after each parallel region would steal those cores, so idle torch threads sleep.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvlab.request import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from kvlab.llm import LLM

        return LLM
    raise AttributeError(name)
