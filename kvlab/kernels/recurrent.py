"""The recurrent layers' kernels of hybrid models, on fp32 per-sequence states.

Ops: `short_conv` (LFM2's short convolution, Mamba-2's conv over xBC), `gated_delta_rule`
(Qwen3.5 / Qwen3-Next Gated DeltaNet), `ssd_scan` (Mamba-2's selective state space scan,
Granite 4 and Nemotron-H) and `gated_rms_norm` (their gated output norms).

A call carries a batch of sequences as contiguous segments of the token dimension:

    tokens  | seq 0: lens[0] tokens | seq 1: lens[1] tokens | ... |      (T = sum(lens))
    states  [num_slots, ...]: row slots[s] is sequence s's state, read and updated in place

so a prefill, a decode step (every lens[s] == 1) and a mix of both are one call. Each op
runs in the C extension (kvlab.kernels._qk, qk_recurrent.c: threaded over sequence x head)
for fp32 CPU tensors and otherwise in the torch implementation below, which is also the
tests' oracle. Prefill runs in the chunked form (chunks of CHUNK tokens, matrix products
within a chunk, the state carried between chunks), decode as the one-token update; both
equal the token-by-token recurrence (`*_recurrent` below) to rounding. The math follows
transformers' torch paths (Qwen3.5 torch_chunk/recurrent_gated_delta_rule, GraniteMoeHybrid
mamba2_chunk_scan / selective_state_update, causal_conv1d_update, RMSNormGated), written
here against the segment layout instead of padded batches.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

if os.environ.get("KVLAB_EMULATE_512"):  # tests only: AVX-512 kernels emulated on AVX2
    from kvlab.kernels import _qk_emu512 as _qk  # built by `make emu512`
else:
    try:
        from kvlab.kernels import _qk
    except ImportError:  # not built: the torch implementation below runs instead
        _qk = None

CHUNK = 64  # tokens per chunk of the chunked prefill forms
ACTIVATIONS = (None, "silu")


# ---- argument checks -------------------------------------------------------------------

def _check_index(slots: torch.Tensor, lens: torch.Tensor) -> None:
    if slots.dim() != 1 or lens.dim() != 1 or slots.numel() != lens.numel():
        raise ValueError(f"slots and lens must be 1-D of one length, got {tuple(slots.shape)} "
                         f"and {tuple(lens.shape)}")


def _check_segments(T: int, states: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> None:
    """The values of slots and lens (the C kernels check them in C: torch's reductions cost
    more than a decode step's kernel)."""
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"lens must be >= 0, got {lens.tolist()}")
    if int(lens.sum()) != T:
        raise ValueError(f"lens sum to {int(lens.sum())} but there are {T} tokens")
    if slots.numel() and not (0 <= int(slots.min()) and int(slots.max()) < states.shape[0]):
        raise ValueError(f"slots must lie in [0, {states.shape[0]}), got {slots.tolist()}")
    if slots.numel() != torch.unique(slots).numel():
        raise ValueError(f"slots must be distinct, got {slots.tolist()}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _segments(slots: torch.Tensor, lens: torch.Tensor) -> list[tuple[int, int, int]]:
    """(slot, first token, token count) of each sequence."""
    out, start = [], 0
    for slot, n in zip(slots.tolist(), lens.tolist(), strict=True):
        out.append((slot, start, n))
        start += n
    return out


def _use_c(*tensors: torch.Tensor) -> bool:
    return _qk is not None and hasattr(_qk, "gated_delta_rule") and all(
        t.is_cpu and t.dtype == torch.float32 for t in tensors)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


# ---- short convolution -----------------------------------------------------------------

def short_conv(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
               slots: torch.Tensor, lens: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str | None = None) -> torch.Tensor:
    """Causal depthwise conv1d of each sequence's tokens x [T, C] with weight [C, K],
    preceded by its state [num_slots, K-1, C] (the K-1 inputs before this step); the state
    becomes the last K-1 inputs. activation None or "silu". Returns [T, C]."""
    T, C = x.shape
    K = weight.shape[1]
    _check_shape("weight", weight, (C, K))
    _check_shape("states", states, (states.shape[0], K - 1, C))
    _check_index(slots, lens)
    if bias is not None:
        _check_shape("bias", bias, (C,))
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if _use_c(states) and states.is_contiguous():
        out = torch.empty(T, C, dtype=torch.float32)
        xc, wc, bc = _f32(x), _f32(weight), None if bias is None else _f32(bias)
        sc, lc = _i64(slots), _i64(lens)
        _qk.short_conv(xc.data_ptr(), wc.data_ptr(), 0 if bc is None else bc.data_ptr(),
                       states.data_ptr(), sc.data_ptr(), lc.data_ptr(), out.data_ptr(),
                       sc.numel(), T, states.shape[0], C, K, int(activation == "silu"))
        return out.to(x.dtype)
    _check_segments(T, states, slots, lens)
    return short_conv_torch(x, weight, states, slots, lens, bias, activation)


def short_conv_torch(x, weight, states, slots, lens, bias=None, activation=None):
    """short_conv in torch (the fallback and the oracle)."""
    T, C = x.shape
    K = weight.shape[1]
    out = torch.empty(T, C, dtype=torch.float32, device=x.device)
    w = weight.float()
    for slot, start, n in _segments(slots, lens):
        xs = torch.cat([states[slot].float(), x[start:start + n].float()])  # [K-1+n, C]
        y = sum(xs[k:k + n] * w[:, k] for k in range(K))
        if bias is not None:
            y = y + bias.float()
        out[start:start + n] = F.silu(y) if activation == "silu" else y
        states[slot] = xs[n:].to(states.dtype)
    return out.to(x.dtype)


# ---- gated delta rule ------------------------------------------------------------------

def _check_gdr(q, k, v, g, beta, states, slots, lens) -> None:
    T, Hk, Dk = k.shape
    Hv, Dv = v.shape[1:]
    _check_shape("q", q, (T, Hk, Dk))
    _check_shape("v", v, (T, Hv, Dv))
    _check_shape("g", g, (T, Hv))
    _check_shape("beta", beta, (T, Hv))
    _check_shape("states", states, (states.shape[0], Hv, Dk, Dv))
    if Hk == 0 or Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    _check_index(slots, lens)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Gated DeltaNet over q, k [T, Hk, Dk] (L2-normalised by the caller), v [T, Hv, Dv],
    log decay g [T, Hv] (<= 0) and beta [T, Hv], from and into states [num_slots, Hv, Dk, Dv].
    Value head h reads key head h // (Hv // Hk). Per token, with S the head's state:
        S = exp(g) S;  S += k (beta (v - k^T S))^T;  out = (scale q)^T S
    Returns [T, Hv, Dv]."""
    _check_gdr(q, k, v, g, beta, states, slots, lens)
    if _use_c(states) and states.is_contiguous():
        T, Hk, Dk = k.shape
        Hv, Dv = v.shape[1:]
        out = torch.empty(T, Hv, Dv, dtype=torch.float32)
        qc, kc, vc, gc, bc = (_f32(t) for t in (q, k, v, g, beta))
        sc, lc = _i64(slots), _i64(lens)
        _qk.gated_delta_rule(qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), gc.data_ptr(),
                             bc.data_ptr(), states.data_ptr(), sc.data_ptr(), lc.data_ptr(),
                             out.data_ptr(), sc.numel(), T, states.shape[0], Hk, Hv, Dk, Dv,
                             float(scale))
        return out.to(v.dtype)
    _check_segments(v.shape[0], states, slots, lens)
    return gated_delta_rule_torch(q, k, v, g, beta, states, slots, lens, scale)


def _gdr_heads(q, k, v, g, beta, start, n):
    """One sequence's inputs as fp32 [Hv, n, ...] with key heads repeated to value heads."""
    rep = v.shape[1] // k.shape[1]
    q, k = (t[start:start + n].float().repeat_interleave(rep, dim=1).transpose(0, 1) for t in (q, k))
    v = v[start:start + n].float().transpose(0, 1)
    g, beta = (t[start:start + n].float().transpose(0, 1) for t in (g, beta))
    return q, k, v, g, beta


def gated_delta_rule_torch(q, k, v, g, beta, states, slots, lens, scale):
    """gated_delta_rule in torch: the chunked form for prefill, one step per decode token."""
    T, Hv, Dv = v.shape
    out = torch.empty(T, Hv, Dv, dtype=torch.float32, device=v.device)
    for slot, start, n in _segments(slots, lens):
        heads = _gdr_heads(q, k, v, g, beta, start, n)
        form = _gdr_chunked if n > 1 else _gdr_recurrent
        y, states[slot] = form(*heads, states[slot].float(), scale)
        out[start:start + n] = y.transpose(0, 1)
    return out.to(v.dtype)


def gated_delta_rule_recurrent(q, k, v, g, beta, states, slots, lens, scale):
    """gated_delta_rule token by token (the tests' oracle)."""
    T, Hv, Dv = v.shape
    out = torch.empty(T, Hv, Dv, dtype=torch.float32, device=v.device)
    for slot, start, n in _segments(slots, lens):
        heads = _gdr_heads(q, k, v, g, beta, start, n)
        y, states[slot] = _gdr_recurrent(*heads, states[slot].float(), scale)
        out[start:start + n] = y.transpose(0, 1)
    return out.to(v.dtype)


def _gdr_recurrent(q, k, v, g, beta, S, scale):
    """q, k [H, n, Dk], v [H, n, Dv], g, beta [H, n], S [H, Dk, Dv] -> ([H, n, Dv], S)."""
    out = torch.empty_like(v)
    q = q * scale
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[:, None, None]
        kv_mem = torch.einsum("hk,hkv->hv", k[:, t], S)
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        S = S + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hk,hkv->hv", q[:, t], S)
    return out, S


def _gdr_chunked(q, k, v, g, beta, S, scale):
    """The chunked form (transformers' torch_chunk_gated_delta_rule on one sequence)."""
    H, n = k.shape[:2]
    pad = (CHUNK - n % CHUNK) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q * scale, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    q, k, v = (t.reshape(H, -1, CHUNK, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(H, -1, CHUNK) for t in (g, beta))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=g.device).triu(1)
    cum = g.cumsum(-1)  # [H, c, L]
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    attn = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None],
                                               upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        v_new = new_v[:, i] - k_cumdecay[:, i] @ S
        out[:, i] = q[:, i] @ S + attn[:, i] @ v_new
        S = S * cum[:, i, -1].exp()[:, None, None] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, -1, v.shape[-1])[:, :n], S


# ---- Mamba-2 selective state space scan ------------------------------------------------

def _check_ssd(x, dt, A, B, C, D, states, slots, lens) -> None:
    T, H, P = x.shape
    G, N = B.shape[1:]
    _check_shape("dt", dt, (T, H))
    _check_shape("A", A, (H,))
    _check_shape("B", B, (T, G, N))
    _check_shape("C", C, (T, G, N))
    if D is not None:
        _check_shape("D", D, (H,))
    _check_shape("states", states, (states.shape[0], H, P, N))
    if G == 0 or H % G:
        raise ValueError(f"heads ({H}) must be a multiple of groups ({G})")
    _check_index(slots, lens)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor | None, states: torch.Tensor,
             slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Mamba-2's scan over x [T, H, P] with dt [T, H] (softplus'ed, biased and clamped by
    the caller), A [H] (< 0), B, C [T, G, N] (head h reads group h // (H // G)), skip D [H],
    from and into states [num_slots, H, P, N]. Per token, with S the head's state:
        S = exp(dt A) S + dt x B^T;  out = S C + D x
    Returns [T, H, P]."""
    _check_ssd(x, dt, A, B, C, D, states, slots, lens)
    if _use_c(states) and states.is_contiguous():
        T, H, P = x.shape
        G, N = B.shape[1:]
        out = torch.empty(T, H, P, dtype=torch.float32)
        xc, dtc, ac, bc, cc = (_f32(t) for t in (x, dt, A, B, C))
        dc = None if D is None else _f32(D)
        sc, lc = _i64(slots), _i64(lens)
        _qk.ssd_scan(xc.data_ptr(), dtc.data_ptr(), ac.data_ptr(), bc.data_ptr(), cc.data_ptr(),
                     0 if dc is None else dc.data_ptr(), states.data_ptr(), sc.data_ptr(),
                     lc.data_ptr(), out.data_ptr(), sc.numel(), T, states.shape[0], H, P, G, N)
        return out.to(x.dtype)
    _check_segments(x.shape[0], states, slots, lens)
    return ssd_scan_torch(x, dt, A, B, C, D, states, slots, lens)


def _ssd_heads(x, dt, B, C, start, n):
    """One sequence's inputs as fp32 [H, n, ...] with groups repeated to heads."""
    rep = x.shape[1] // B.shape[1]
    B, C = (t[start:start + n].float().repeat_interleave(rep, dim=1).transpose(0, 1) for t in (B, C))
    return x[start:start + n].float().transpose(0, 1), dt[start:start + n].float().t(), B, C


def _ssd_sequences(x, dt, A, B, C, D, states, slots, lens, chunked: bool):
    T, H, P = x.shape
    out = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    for slot, start, n in _segments(slots, lens):
        xs, dts, Bs, Cs = _ssd_heads(x, dt, B, C, start, n)
        form = _ssd_chunked if chunked and n > 1 else _ssd_recurrent
        y, states[slot] = form(xs, dts, A.float(), Bs, Cs, states[slot].float())
        if D is not None:
            y = y + D.float()[:, None, None] * xs
        out[start:start + n] = y.transpose(0, 1)
    return out.to(x.dtype)


def ssd_scan_torch(x, dt, A, B, C, D, states, slots, lens):
    """ssd_scan in torch: the chunked form for prefill, one step per decode token."""
    return _ssd_sequences(x, dt, A, B, C, D, states, slots, lens, chunked=True)


def ssd_scan_recurrent(x, dt, A, B, C, D, states, slots, lens):
    """ssd_scan token by token (the tests' oracle)."""
    return _ssd_sequences(x, dt, A, B, C, D, states, slots, lens, chunked=False)


def _ssd_recurrent(x, dt, A, B, C, S):
    """x [H, n, P], dt [H, n], A [H], B, C [H, n, N], S [H, P, N] -> ([H, n, P], S)."""
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        dA = (dt[:, t] * A).exp()[:, None, None]
        S = S * dA + (dt[:, t, None] * x[:, t])[:, :, None] * B[:, t, None, :]
        out[:, t] = torch.einsum("hpn,hn->hp", S, C[:, t])
    return out, S


def _ssd_chunked(x, dt, A, B, C, S):
    """The chunked form (transformers' mamba2_chunk_scan on one sequence): within a chunk
    out = (C B^T * decay) (dt x) + decayed C S0, and S carried from chunk to chunk."""
    H, n, P = x.shape
    pad = (CHUNK - n % CHUNK) % CHUNK
    xdt = F.pad(x * dt[..., None], (0, 0, 0, pad)).reshape(H, -1, CHUNK, P)
    B, C = (F.pad(t, (0, 0, 0, pad)).reshape(H, -1, CHUNK, t.shape[-1]) for t in (B, C))
    cum = F.pad(dt * A[:, None], (0, pad)).reshape(H, -1, CHUNK).cumsum(-1)  # [H, c, L]
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=cum.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    y_diag = ((C @ B.transpose(-1, -2)) * decay) @ xdt
    to_end = (cum[..., -1:] - cum).exp()  # decay from each token to the chunk's end
    out = torch.empty_like(xdt)
    for i in range(xdt.shape[1]):
        out[:, i] = y_diag[:, i] + (C[:, i] @ S.transpose(-1, -2)) * cum[:, i, :, None].exp()
        S = S * cum[:, i, -1].exp()[:, None, None] + (xdt[:, i] * to_end[:, i, :, None]).transpose(-1, -2) @ B[:, i]
    return out.reshape(H, -1, P)[:, :n], S


# ---- gated RMS norm --------------------------------------------------------------------

def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   group_size: int, norm_before_gate: bool) -> torch.Tensor:
    """RMSNorm over groups of group_size along the last dim of x [..., D], gated by
    silu(z): norm(x) * weight * silu(z) when norm_before_gate (Qwen3.5), else
    norm(x * silu(z)) * weight (Mamba-2). Returns x's shape and dtype."""
    D = x.shape[-1]
    _check_shape("z", z, tuple(x.shape))
    _check_shape("weight", weight, (D,))
    if group_size <= 0 or D % group_size:
        raise ValueError(f"group_size must divide the last dim {D}, got {group_size}")
    if _use_c(x, z) and x.numel():
        xc, zc, wc = _f32(x), _f32(z), _f32(weight)
        out = torch.empty_like(xc)
        _qk.gated_rms_norm(xc.data_ptr(), zc.data_ptr(), wc.data_ptr(), out.data_ptr(),
                           xc.numel() // D, D, group_size, float(eps), int(norm_before_gate))
        return out
    return gated_rms_norm_torch(x, z, weight, eps, group_size, norm_before_gate)


def gated_rms_norm_torch(x, z, weight, eps, group_size, norm_before_gate):
    """gated_rms_norm in torch (the fallback and the oracle)."""
    h, gate = x.float(), F.silu(z.float())
    if not norm_before_gate:
        h = h * gate
    grouped = h.unflatten(-1, (-1, group_size))
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    y = grouped.flatten(-2) * weight.float()
    if norm_before_gate:
        y = y * gate
    return y.to(x.dtype)
