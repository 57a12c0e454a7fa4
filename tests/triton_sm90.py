"""Compiles kvlab.gpu's Triton kernels for an H100/H200 (sm_90) without a GPU, in each
configuration the decode plan launches: the compiler checks what Triton's interpreter does
not (types through scf.if, constexpr branches, dot shapes). Run by tests/test_triton_fused.py
in a process of its own, as TRITON_INTERPRET=1 there turns every kernel into an interpreted
one. Prints one line per kernel; exits 1 if any fails."""

from __future__ import annotations

import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvlab.gpu import attention, fused

TARGET = GPUTarget("cuda", 90, 32)


def compiles(name: str, fn, signature: dict[str, str], constexprs: dict[str, object]) -> bool:
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    try:
        triton.compile(ASTSource(fn, signature, constexprs), target=TARGET)
    except Exception:  # noqa: BLE001 - report every kernel, then fail
        print(f"FAILED {name}\n{traceback.format_exc()[-3000:]}")
        return False
    print(f"ok {name}")
    return True


def residual_norms() -> list[bool]:
    sig = {"x_ptr": "*fp32", "h_ptr": "*bf16", "post_ptr": "*fp32", "w_ptr": "*fp32",
           "out_ptr": "*bf16", "n_cols": "i32", "eps": "fp32"}
    return [compiles(f"residual_norm h={h} post={post} out={out}", fused._residual_norm_kernel,
                     dict(sig), {"HAS_H": h, "HAS_POST": post, "HAS_OUT": out, "BLOCK": 4096})
            for h, post, out in ((False, False, True), (True, True, True), (True, False, False))]


def qkv_and_gates() -> list[bool]:
    sig = {"qkv_ptr": "*bf16", "qkv_stride": "i32", "q_norm_ptr": "*fp32",
           "k_norm_ptr": "*fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64",
           "slot_stride": "i32", "q_out_ptr": "*bf16", "k_cache_ptr": "*bf16",
           "v_cache_ptr": "*bf16", "eps": "fp32"}
    ok = [compiles(f"qkv_rope_write qk_norm={n}", fused._qkv_rope_write_kernel, dict(sig),
                   {"HEADS": 32, "KV_HEADS": 8, "HALF": 64, "BLOCK": 64, "Q_NORM": n,
                    "K_NORM": n}) for n in (False, True)]
    return ok + [compiles(f"gated gelu_tanh={g}", fused._gated_kernel,
                          {"y_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32"},
                          {"GELU_TANH": g, "BLOCK": 1024}) for g in (False, True)]


def attentions() -> list[bool]:
    ok = []
    # splits, lengths (else a mask), soft-cap and sinks, store dtype, head_dim
    for splits, lengths, capped, dtype, dim in ((4, False, False, "bf16", 128),
                                                (1, True, True, "bf16", 256),
                                                (2, True, False, "fp32", 64)):
        sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
               "table_ptr": "*i64", "table_stride": "i32", "len_ptr": "*i64",
               "len_stride": "i32", "mask_ptr": "*u8", "mask_stride": "i32",
               "sink_ptr": "*fp32", "out_ptr": f"*{dtype}", "part_ml_ptr": "*fp32",
               "part_acc_ptr": "*fp32", "width": "i32", "window": "i32", "scale": "fp32",
               "cap": "fp32"}
        ok.append(compiles(
            f"paged decode splits={splits} lengths={lengths} capped={capped} {dtype} d={dim}",
            attention._decode_kernel, sig,
            {"KV_HEADS": 8, "GROUP": 4, "GROUP_PAD": 16, "D": dim, "D_PAD": dim, "PAGE": 1,
             "BLOCK_N": 64 if dim <= 128 else 32, "SPLITS": splits, "HAS_LEN": lengths,
             "HAS_MASK": not lengths, "HAS_CAP": capped, "HAS_SINK": capped,
             "EXACT": dtype == "fp32"}))
    ok.append(compiles("merge splits", attention._merge_kernel,
                       {"part_ml_ptr": "*fp32", "part_acc_ptr": "*fp32", "sink_ptr": "*fp32",
                        "out_ptr": "*bf16", "heads": "i32"},
                       {"D": 128, "D_PAD": 128, "SPLITS": 4, "SPLITS_PAD": 4,
                        "HAS_SINK": True}))
    return ok


if __name__ == "__main__":
    results = residual_norms() + qkv_and_gates() + attentions()
    print(f"compiled {sum(results)} of {len(results)}")
    sys.exit(0 if all(results) else 1)
