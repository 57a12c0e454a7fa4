"""Batch-1 decode products by quant type, on any GGUF, read against this machine's bandwidth.

    .venv/bin/python bench/decode_kernels.py -m FILE.gguf [-t 1,2] [--reps 7]

For each quant type among the file's layer matrices, the matrices in the layout the engine
multiplies them in (8-row groups where the type has them, as loaded), enough of them (or
of copies of them) to exceed the last-level cache 8 times, so every product streams from
DRAM as in a decode step, each multiplied by one random x row in turn. Prints GB/s of the bytes the kernels read (median and
best of --reps passes) and that as a share of kvlab's probed read bandwidth at the same
thread count, measured in the same run: a type far below the others is compute-bound there.
Each product is its own call here, so small matrices (Gemma 3 270M's are 0.2-1.6 MB) also
show the per-call cost that the one-call C decode layers avoid.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from kvlab.kernels import QuantizedWeight, kernel_backend_detail, qmatmul, set_num_threads
from kvlab.kernels.ops import can_group, group_rows
from kvlab.probe.machine import measure_bandwidth
from kvlab.weights.gguf_file import GGUFFile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import pass_times  # the sibling script's timing, by path

SET_BYTES = 256e6  # per type: 8x the 32 MiB L3 of the machines kvlab is measured on


def matrices_by_type(file: GGUFFile) -> dict[T, list[QuantizedWeight]]:
    """Each type's layer matrices in the decode layout, up to SET_BYTES, by type; where the
    file holds less of a type, copies of them (distinct buffers) up to SET_BYTES."""
    out: dict[T, list[QuantizedWeight]] = {}
    for name, t in file.tensors.items():
        if len(t.shape) != 2 or not name.startswith("blk.") or t.qtype in (T.F32, T.F16, T.BF16):
            continue
        ws = out.setdefault(t.qtype, [])
        if sum(w.nbytes for w in ws) < SET_BYTES:
            w = QuantizedWeight.from_gguf(file, name)
            ws.append(group_rows(w) if can_group(w) else w)
    for ws in out.values():
        originals = list(ws)
        while sum(w.nbytes for w in ws) < SET_BYTES:
            ws.extend(QuantizedWeight(w.qtype, w.shape, w.data.clone(), grouped=w.grouped)
                      for w in originals)
    return out


def type_gbps(ws: list[QuantizedWeight], reps: int) -> tuple[float, float]:
    """(median, best) GB/s of one pass of batch-1 products over `ws`."""
    xs = {w.in_features: torch.randn(1, w.in_features) for w in ws}

    def one_pass() -> None:
        for w in ws:
            qmatmul(xs[w.in_features], w)

    times = pass_times(one_pass, reps)
    nbytes = sum(w.nbytes for w in ws)
    return nbytes / statistics.median(times) / 1e9, nbytes / min(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True, help="a GGUF file")
    ap.add_argument("-t", "--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    by_type = matrices_by_type(GGUFFile(args.model))
    print(f"kernels: {kernel_backend_detail()}   model: {args.model}")
    for nt in [int(v) for v in args.threads.split(",")]:
        set_num_threads(nt)
        torch.set_num_threads(nt)
        bw = measure_bandwidth(512, 3.0)[0] / 1e9
        print(f"\n== {nt} thread(s): read bandwidth {bw:.1f} GB/s (kvlab probe, 512 MiB)")
        for qtype, ws in by_type.items():
            med, best = type_gbps(ws, args.reps)
            layout = "8-row groups" if ws[0].grouped else "file rows"
            mb = sum(w.nbytes for w in ws) / 1e6
            print(f"{qtype.name:<7} {len(ws):3d} matrices, {mb:4.0f} MB ({layout}): "
                  f"{med:5.1f} GB/s (best {best:5.1f}) = {med / bw:4.0%} of bandwidth")


if __name__ == "__main__":
    main()
