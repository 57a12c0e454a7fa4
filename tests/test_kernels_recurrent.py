"""The recurrent-layer kernels (kvlab.kernels.recurrent): the C kernels and the torch chunked
forms against the token-by-token recurrence, which is checked against transformers' own torch
paths (Qwen3.5 gated delta rule, GraniteMoeHybrid's Mamba-2 scan, conv and gated norms).
Batches mix sequences of unequal lengths; decode steps after a prefill must equal one long
prefill; states round-trip through their slots."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_paths import EMULATED_512, emulated_512_built
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen35

from kvlab.kernels import recurrent as rc

LENS = [70, 1, 5, 130, 64]  # chunk-crossing, decode-sized, short, two chunks + a bit, one chunk
SLOTS = [3, 0, 5, 1, 2]
NUM_SLOTS = 6


def _close(a, b, rel=1e-4):
    err = (a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)
    assert err <= rel, f"relative error {float(err):.3g} > {rel}"


def _seg(lens=LENS, slots=SLOTS):
    return torch.tensor(slots), torch.tensor(lens)


def _gdr_inputs(T, Hk, Hv, Dk, Dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(T, Hk, Dk, generator=gen), dim=-1)
    v = torch.randn(T, Hv, Dv, generator=gen)
    g = -F.softplus(torch.randn(T, Hv, generator=gen)) * 0.3
    beta = torch.rand(T, Hv, generator=gen)
    states = torch.randn(NUM_SLOTS, Hv, Dk, Dv, generator=gen) * 0.1
    return q, k, v, g, beta, states


def _ssd_inputs(T, H, P, G, N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=gen)
    dt = F.softplus(torch.randn(T, H, generator=gen) - 1).clamp(0.001, 1.0)
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    B = torch.randn(T, G, N, generator=gen)
    C = torch.randn(T, G, N, generator=gen)
    D = torch.randn(H, generator=gen)
    states = torch.randn(NUM_SLOTS, H, P, N, generator=gen) * 0.1
    return x, dt, A, B, C, D, states


# ---- the recurrences against transformers ----------------------------------------------

@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4)])
def test_gated_delta_rule_recurrence_matches_transformers(Hk, Hv):
    q, k, v, g, beta, states = _gdr_inputs(sum(LENS), Hk, Hv, 16, 8)
    ours = states.clone()
    out = rc.gated_delta_rule_recurrent(q, k, v, g, beta, ours, *_seg(), scale=16 ** -0.5)
    start = 0
    for slot, n in zip(SLOTS, LENS, strict=True):
        seg = slice(start, start + n)
        ref, final = qwen35.torch_recurrent_gated_delta_rule(
            q[None, seg], k[None, seg], v[None, seg], g[None, seg], beta[None, seg],
            initial_state=states[slot:slot + 1], output_final_state=True)
        _close(out[seg], ref[0])
        _close(ours[slot], final[0])
        start += n


@pytest.mark.parametrize("G", [1, 2])
def test_ssd_recurrence_matches_transformers_chunk_scan(G):
    x, dt, A, B, C, D, states = _ssd_inputs(sum(LENS), 4, 8, G, 16)
    ours = states.clone()
    out = rc.ssd_scan_recurrent(x, dt, A, B, C, D, ours, *_seg())
    start = 0
    for slot, n in zip(SLOTS, LENS, strict=True):
        seg = slice(start, start + n)
        ref, final = granite.mamba2_chunk_scan(
            x[None, seg], dt[None, seg], A, B[None, seg], C[None, seg], chunk_size=32, D=D,
            initial_states=states[slot:slot + 1], return_final_states=True)
        _close(out[seg], ref[0])
        _close(ours[slot], final[0])
        start += n


def test_ssd_decode_step_matches_transformers_state_update():
    x, dt, A, B, C, D, states = _ssd_inputs(3, 4, 8, 2, 16)
    ours, ref_state = states.clone(), states[[2, 0, 4]].clone()
    out = rc.ssd_scan(x, dt, A, B, C, D, ours, *_seg([1, 1, 1], [2, 0, 4]))
    P, N = 8, 16
    ref = granite.mamba2_selective_state_update(
        ref_state, x, dt[..., None].expand(-1, -1, P), A[:, None, None].expand(-1, P, N), B, C,
        D[:, None].expand(-1, P))
    _close(out, ref)
    _close(ours[[2, 0, 4]], ref_state)


@pytest.mark.parametrize("bias,activation", [(False, None), (True, "silu")])
def test_short_conv_matches_transformers_conv_update(bias, activation):
    T, Cn, K = sum(LENS), 24, 4
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(T, Cn, generator=gen), torch.randn(Cn, K, generator=gen)
    b = torch.randn(Cn, generator=gen) if bias else None
    states = torch.randn(NUM_SLOTS, K - 1, Cn, generator=gen)
    ours = states.clone()
    out = rc.short_conv(x, w, ours, *_seg(), bias=b, activation=activation)
    start = 0
    for slot, n in zip(SLOTS, LENS, strict=True):
        conv_state = states[slot].t()[None].clone()  # transformers' [batch, C, K-1]
        ref = granite.causal_conv1d_update(x[None, start:start + n].transpose(1, 2), conv_state,
                                           w, b, activation=activation)
        _close(out[start:start + n], ref[0].t())
        _close(ours[slot], conv_state[0].t())
        start += n


def test_gated_rms_norms_match_transformers():
    gen = torch.Generator().manual_seed(2)
    x, z = torch.randn(7, 3, 32, generator=gen), torch.randn(7, 3, 32, generator=gen)
    qwen = qwen35.Qwen3_5RMSNormGated(32, eps=1e-6)
    mamba = granite.GraniteMoeHybridRMSNormGated(96, group_size=48, eps=1e-5)
    with torch.no_grad():
        qwen.weight.normal_(generator=gen)
        mamba.weight.normal_(generator=gen)
        _close(rc.gated_rms_norm(x, z, qwen.weight, 1e-6, 32, True), qwen(x, z))
        x2, z2 = x.reshape(7, 96), z.reshape(7, 96)
        _close(rc.gated_rms_norm(x2, z2, mamba.weight, 1e-5, 48, False), mamba(x2, z2))


# ---- every implementation against the recurrence ---------------------------------------

GDR_IMPLS = {"dispatch": rc.gated_delta_rule, "portable": rc.gated_delta_rule,
             "torch": rc.gated_delta_rule_torch}
SSD_IMPLS = {"dispatch": rc.ssd_scan, "portable": rc.ssd_scan, "torch": rc.ssd_scan_torch}


@pytest.fixture
def kernel_set(request):
    """'portable' pins the C kernels' portable path for the test (where the C kernels run)."""
    impl = request.node.callspec.params.get("impl")
    if impl == "portable":
        if rc._qk is None:
            pytest.skip("C kernels not built")
        rc._qk.set_isa("generic")
        yield
        rc._qk.set_isa("auto")
    else:
        yield


@pytest.mark.parametrize("impl", GDR_IMPLS)
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(2, 2, 16, 8), (2, 6, 32, 16), (1, 2, 64, 64)])
def test_gated_delta_rule_batch_matches_recurrence(kernel_set, impl, Hk, Hv, Dk, Dv):
    q, k, v, g, beta, states = _gdr_inputs(sum(LENS), Hk, Hv, Dk, Dv)
    ref_states, ours = states.clone(), states.clone()
    ref = rc.gated_delta_rule_recurrent(q, k, v, g, beta, ref_states, *_seg(), scale=0.3)
    out = GDR_IMPLS[impl](q, k, v, g, beta, ours, *_seg(), scale=0.3)
    _close(out, ref)
    _close(ours, ref_states)


@pytest.mark.parametrize("impl", SSD_IMPLS)
@pytest.mark.parametrize("H,P,G,N,skip", [(4, 8, 1, 16, True), (6, 16, 3, 32, False), (2, 64, 2, 128, True)])
def test_ssd_scan_batch_matches_recurrence(kernel_set, impl, H, P, G, N, skip):
    x, dt, A, B, C, D, states = _ssd_inputs(sum(LENS), H, P, G, N)
    D = D if skip else None
    ref_states, ours = states.clone(), states.clone()
    ref = rc.ssd_scan_recurrent(x, dt, A, B, C, D, ref_states, *_seg())
    out = SSD_IMPLS[impl](x, dt, A, B, C, D, ours, *_seg())
    _close(out, ref)
    _close(ours, ref_states)


@pytest.mark.parametrize("impl", ["dispatch", "portable", "torch"])
def test_short_conv_matches_a_padded_conv1d(kernel_set, impl):
    """From zero states, each sequence's output is conv1d with K-1 zeros of left padding."""
    T, Cn, K = sum(LENS), 40, 4
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(T, Cn, generator=gen), torch.randn(Cn, K, generator=gen), torch.randn(Cn, generator=gen)
    states = torch.zeros(NUM_SLOTS, K - 1, Cn)
    fn = rc.short_conv if impl == "dispatch" else rc.short_conv_torch
    out = fn(x, w, states, *_seg(), b, "silu")
    start = 0
    for slot, n in zip(SLOTS, LENS, strict=True):
        seg = x[start:start + n].t()[None]
        ref = F.silu(F.conv1d(seg, w[:, None], b, padding=K - 1, groups=Cn)[0, :, :n].t())
        _close(out[start:start + n], ref)
        last = F.pad(seg[0], (K - 1, 0))[:, -(K - 1):].t()
        _close(states[slot], last)
        start += n


def _decode_after_prefill(op, inputs, token_dims, split):
    """Run op once over a whole sequence, then as a prefill of `split` tokens and single-token
    decode steps, both from the same state in slot 1 (slot 0 holds another sequence)."""
    states = inputs[-1]
    T = token_dims[0].shape[0]
    whole_states = states.clone()
    whole = op(*token_dims, *inputs[:-1], whole_states, torch.tensor([1]), torch.tensor([T]))
    outs, step_states = [], states.clone()
    bounds = [0, split, *range(split + 1, T + 1)]
    for a, b in itertools.pairwise(bounds):
        outs.append(op(*(t[a:b] for t in token_dims), *inputs[:-1], step_states,
                       torch.tensor([1]), torch.tensor([b - a])))
    _close(torch.cat(outs), whole)
    _close(step_states, whole_states)
    assert torch.equal(step_states[0], states[0])  # other slots untouched


@pytest.mark.parametrize("impl", ["dispatch", "portable"])
def test_decode_steps_after_prefill_equal_one_long_prefill(kernel_set, impl):
    T = 75
    q, k, v, g, beta, st = _gdr_inputs(T, 2, 4, 32, 16)
    st = st[:2].clone()
    _decode_after_prefill(lambda q, k, v, g, beta, s, sl, ln: rc.gated_delta_rule(q, k, v, g, beta, s, sl, ln, 0.2),
                          [st], [q, k, v, g, beta], split=66)
    x, dt, A, B, C, D, st = _ssd_inputs(T, 4, 8, 2, 16)
    _decode_after_prefill(lambda x, dt, B, C, A, D, s, sl, ln: rc.ssd_scan(x, dt, A, B, C, D, s, sl, ln),
                          [A, D, st[:2].clone()], [x, dt, B, C], split=66)
    w, st = torch.randn(24, 4), torch.randn(2, 3, 24)
    _decode_after_prefill(lambda x, w, s, sl, ln: rc.short_conv(x, w, s, sl, ln, activation="silu"),
                          [w, st], [torch.randn(T, 24)], split=2)


@pytest.mark.parametrize("impl", ["dispatch", "portable"])
def test_state_round_trip_through_slots(kernel_set, impl):
    """A sequence's state saved from one slot and restored into another continues it exactly."""
    q, k, v, g, beta, states = _gdr_inputs(40, 2, 2, 16, 16)
    a = states.clone()
    rc.gated_delta_rule(q[:30], k[:30], v[:30], g[:30], beta[:30], a, torch.tensor([4]), torch.tensor([30]), 0.25)
    saved = a[4].clone()
    b = torch.zeros_like(states)
    b[2] = saved
    out_a = rc.gated_delta_rule(q[30:], k[30:], v[30:], g[30:], beta[30:], a, torch.tensor([4]), torch.tensor([10]), 0.25)
    out_b = rc.gated_delta_rule(q[30:], k[30:], v[30:], g[30:], beta[30:], b, torch.tensor([2]), torch.tensor([10]), 0.25)
    assert torch.equal(out_a, out_b)
    assert torch.equal(a[4], b[2])


@pytest.mark.parametrize("impl", ["dispatch", "portable"])
def test_gated_rms_norm_dispatch_matches_torch(kernel_set, impl):
    gen = torch.Generator().manual_seed(4)
    x, z, w = torch.randn(9, 5, 64, generator=gen), torch.randn(9, 5, 64, generator=gen), torch.randn(64, generator=gen)
    for group, before in [(64, True), (16, False), (32, True)]:
        _close(rc.gated_rms_norm(x, z, w, 1e-6, group, before), rc.gated_rms_norm_torch(x, z, w, 1e-6, group, before))


def test_bad_arguments_are_refused_naming_the_problem():
    q, k, v, g, beta, states = _gdr_inputs(6, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="multiple of key heads"):
        rc.gated_delta_rule(q, k, v, g, beta, torch.zeros(2, 3, 8, 8), torch.tensor([0]), torch.tensor([6]), 1.0)
    q, k, v, g, beta, states = _gdr_inputs(6, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="lens sum to 5"):
        rc.gated_delta_rule(q, k, v, g, beta, states, torch.tensor([0]), torch.tensor([5]), 1.0)
    with pytest.raises(ValueError, match="slots must lie in"):
        rc.gated_delta_rule(q, k, v, g, beta, states, torch.tensor([9]), torch.tensor([6]), 1.0)
    with pytest.raises(ValueError, match="slots must be distinct"):
        rc.gated_delta_rule(q, k, v, g, beta, states, torch.tensor([1, 1]), torch.tensor([3, 3]), 1.0)
    with pytest.raises(ValueError, match="lens must be >= 0"):
        rc.gated_delta_rule(q, k, v, g, beta, states, torch.tensor([0, 1]), torch.tensor([7, -1]), 1.0)
    with pytest.raises(ValueError, match="activation must be one of"):
        rc.short_conv(torch.zeros(2, 4), torch.zeros(4, 3), torch.zeros(1, 2, 4), torch.tensor([0]),
                      torch.tensor([2]), activation="gelu")
    with pytest.raises(ValueError, match="group_size must divide"):
        rc.gated_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(8), 1e-6, 3, True)


@pytest.mark.skipif(not emulated_512_built(), reason="AVX-512 test module not built: make emu512")
@pytest.mark.skipif(bool(os.environ.get("KVLAB_EMULATE_512")), reason="already the emulated run")
def test_the_recurrent_kernel_tests_pass_on_the_emulated_avx512_kernels():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env={**os.environ, **EMULATED_512}, capture_output=True, text=True,
                         check=False, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "passed" in run.stdout and " failed" not in run.stdout


@pytest.mark.parametrize("impl", ["dispatch", "portable"])
def test_strong_decays_and_empty_sequences(kernel_set, impl):
    """Decays that underflow exp within a chunk, and sequences with no tokens this step (their
    states untouched), still match the recurrence."""
    lens, slots = [0, 90, 0, 3], [4, 1, 0, 2]
    q, k, v, g, beta, states = _gdr_inputs(sum(lens), 2, 4, 16, 16)
    g = g * 60  # cumulated over a chunk: thousands below zero
    ref_states, ours = states.clone(), states.clone()
    ref = rc.gated_delta_rule_recurrent(q, k, v, g, beta, ref_states, *_seg(lens, slots), scale=0.3)
    _close(rc.gated_delta_rule(q, k, v, g, beta, ours, *_seg(lens, slots), scale=0.3), ref)
    _close(ours, ref_states)
    assert torch.equal(ours[[4, 0]], states[[4, 0]])
    x, dt, A, B, C, D, states = _ssd_inputs(sum(lens), 4, 8, 2, 16)
    A = A * 200
    ref_states, ours = states.clone(), states.clone()
    ref = rc.ssd_scan_recurrent(x, dt, A, B, C, D, ref_states, *_seg(lens, slots))
    _close(rc.ssd_scan(x, dt, A, B, C, D, ours, *_seg(lens, slots)), ref)
    _close(ours, ref_states)
    assert torch.equal(ours[[4, 0]], states[[4, 0]])
