"""Verifying proposed tokens against the target model: speculative rejection sampling.

For each proposed token x, in order, the target distribution p at its position (the one
kvlab.sampler would draw from there: structure mask, bias, penalties, temperature, top-k,
top-p, min-p; kvlab.sampler.target_probs) decides. A deterministic proposer's q is one-hot,
so the rule of Leviathan et al. / Chen et al. becomes:

    accept x with probability p(x);
    else draw from p with x removed and renormalised, and stop;
    after the last accepted proposal, draw one more token from p at the next position.

Each emitted token then has exactly the target's distribution: P(x) = p(x) + (1 - p(x)) * 0
for the proposal, and (1 - p(x)) * p(y) / (1 - p(x)) = p(y) for any other y. A greedy row's
p is one-hot at the argmax, so it accepts x exactly when x is the argmax and otherwise emits
the argmax: the text of plain greedy decoding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvlab.kernels import fused


def draw(probs: Tensor, greedy: bool, generator: torch.Generator,
         exclude: int | None = None) -> int:
    """One token from probs [V] (need not sum to 1), never `exclude`: its argmax on a
    greedy row, else the exponential race the sampler runs (argmax of probs / q, q ~
    Exp(1)). A greedy row is one-hot, so a token it excludes (a rejected proposal) already
    has probability 0; a sampled row's race is run in the noise's own buffer, the excluded
    token's score zeroed there (the residual distribution without a copy of probs)."""
    if greedy:
        return int(fused.argmax(probs[None])[0])
    q = torch.empty_like(probs).exponential_(generator=generator)
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    torch.div(probs, q, out=q)
    if exclude is not None:
        q[exclude] = 0.0
    return int(fused.argmax(q[None])[0])


def judge(probs: Tensor, proposed: int | None, greedy: bool,
          generator: torch.Generator) -> tuple[int, bool]:
    """(the token emitted at this position, whether it is the proposal) for target probs
    [V] and a proposal (None: nothing proposed here, draw from probs)."""
    if proposed is None:
        return draw(probs, greedy, generator), False
    p = float(probs[proposed])
    if greedy:
        keep = p > 0.5  # one-hot
    else:
        u = float(torch.rand((), generator=generator, device=probs.device))
        keep = u < p
    if keep:
        return proposed, True
    return draw(probs, greedy, generator, exclude=proposed), False
