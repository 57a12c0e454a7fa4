"""kvlab's step model (kvlab.estimate.kernel_steps) checked by hand on round numbers, and
`kvlab bench --estimate` / `kvlab estimate --engine kvlab` built on it."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kvlab.cli import bench_estimate
from kvlab.cost import MatrixSpec
from kvlab.errors import KvlabError
from kvlab.estimate import HardwareSpec, LayerSpec, ModelSpec, Workload, bench_check
from kvlab.estimate.hardware import KernelRates
from kvlab.estimate.kernel_steps import (
    DecodeTerms,
    loaded_matrix,
    product_calls,
    reply_contexts,
    unsupported_reason,
)
from kvlab.estimate.specs import spec_from_description
from kvlab.estimate.step_model import predict
from kvlab.harness.llama_bench import BenchResult
from kvlab.probe.cache import PROBE_VERSION, ProbeResult, save_probe
from kvlab.probe.engine_overhead import SyntheticShape, write_synthetic_gguf

US, NS = 1e-6, 1e-9


def rates(**changes: object) -> KernelRates:
    """Round figures for the types the loader makes of Q8_0 and Q4_K: 10 and 20 GB/s, 1 ns
    a row, 5 us a call."""
    base = KernelRates(
        threads=2, weight_read={"Q8_0x8": 10e9, "Q4_Kx8": 20e9},
        row_seconds={"Q8_0x8": NS, "Q4_Kx8": NS},
        prefill_ops={"Q8_0x8": 100e9, "Q4_Kx8": 200e9}, call_seconds=5 * US,
        attention_read=4e9, attention_read_strided=2e9, logit_seconds=NS,
        row_op_seconds={"norm": NS, "rope": NS, "gelu": 2 * NS, "silu": NS},
        step_seconds={"llama": 100 * US, "gemma3": 200 * US},
        layer_seconds={"llama": 10 * US, "gemma3": 20 * US},
        position_seconds={"llama": 10 * NS, "gemma3": 20 * NS})
    return replace(base, **changes)  # type: ignore[arg-type]


def machine(**changes: object) -> HardwareSpec:
    return HardwareSpec(name="test machine", bandwidth=50e9, flops={"fp32": 100e9},
                        memory_bytes=None, key="this", kernels=rates(**changes))


def layer(window: int | None = None, qkv: tuple[str, str, str] = ("Q8_0", "Q8_0", "Q8_0")
          ) -> LayerSpec:
    """hidden 64, 4 heads and 1 KV head of 16, FFN 128; q|k|v types as given."""
    q, k, v = qkv
    mats = (MatrixSpec(q, 64, 64, 1_000_000, "attn_q"), MatrixSpec(k, 16, 64, 0, "attn_k"),
            MatrixSpec(v, 16, 64, 0, "attn_v"), MatrixSpec("Q8_0", 64, 64, 0, "attn_output"),
            MatrixSpec("Q4_K", 128, 64, 2_000_000, "ffn_gate"),
            MatrixSpec("Q4_K", 128, 64, 0, "ffn_up"), MatrixSpec("Q8_0", 64, 128, 0, "ffn_down"))
    return LayerSpec(dense_bytes=3_000_000, dense_params=4096, kv_elements=32,
                     attn_flop_per_key=2 * 4 * 32, window=window, heads=4, kv_heads=1,
                     ffn_width=128, matrices=mats)


def model(arch: str = "llama", layers: tuple[LayerSpec, ...] | None = None) -> ModelSpec:
    layers = layers or (layer(), layer())
    return ModelSpec(name="hand", source="gguf", n_params=1, weight_bytes=1, layers=layers,
                     output_params=1000 * 64, output_bytes=10_000_000, vocab_size=1000,
                     hidden_size=64, architecture=arch,
                     output_matrix=MatrixSpec("Q8_0", 1000, 64, 10_000_000, "output"))


def test_decode_step_is_weights_plus_kv_plus_overhead() -> None:
    p = predict(model(), machine(), Workload(prompt_tokens=99, output_tokens=2))
    assert reply_contexts(p.workload) == [100]
    # weights: 1 MB q (Q8_0 -> Q8_0x8, 10 GB/s) + 2 MB gate (Q4_K -> Q4_Kx8, its own
    # size, 20 GB/s) per layer, the 10 MB output; rows: (64+16+16+64+128+128+64) per
    # layer + 1000 at 1 ns; calls: q|k|v joined, gate|up joined -> 4 per layer + output = 9
    weights = (2 * (100 * US + 100 * US) + 1000 * US + (2 * 480 + 1000) * NS
               + 9 * 5 * US)
    # KV: 32 f32 values a position, 100 positions, 2 layers, one pass (4 heads a pass), 4 GB/s
    kv = 2 * 32 * 4 * 100 / 4e9
    # overhead: llama 100 us a step + 2 x 10 us + 100 positions x 10 ns + 1000 logits x 1 ns
    overhead = 100 * US + 2 * 10 * US + 100 * 10 * NS + 1000 * NS
    assert p.decode.weights == pytest.approx(weights)
    assert p.decode.kv == pytest.approx(kv)
    assert p.decode.overhead == pytest.approx(overhead)
    assert p.decode_tok_s == pytest.approx(1 / (weights + kv + overhead))


def test_kv_term_follows_windows_passes_and_layout() -> None:
    wl = Workload(prompt_tokens=999, output_tokens=2)  # one step at context 1000
    full = predict(model(), machine(), wl).decode.kv
    windowed = predict(model(layers=(layer(window=100), layer())), machine(), wl).decode.kv
    assert windowed == pytest.approx(full * (100 + 1000) / 2000)
    # 8 query heads a KV head take two passes over its keys; 2 KV heads a row read strided
    eight = LayerSpec(**{**layer().__dict__, "heads": 8})
    assert predict(model(layers=(eight, eight)), machine(), wl).decode.kv == \
        pytest.approx(2 * full)
    strided = LayerSpec(**{**layer().__dict__, "heads": 8, "kv_heads": 2, "kv_elements": 64})
    assert predict(model(layers=(strided, strided)), machine(), wl).decode.kv == \
        pytest.approx(2 * full * 4e9 / 2e9)


def test_mean_step_over_the_reply() -> None:
    p = predict(model(), machine(), Workload(prompt_tokens=100, output_tokens=101))
    assert p.decode_first.kv < p.decode.kv < p.decode_last.kv
    mean_kv = (p.decode_first.kv + p.decode_last.kv) / 2  # linear in context
    assert p.decode.kv == pytest.approx(mean_kv)
    assert p.total_seconds == pytest.approx(p.ttft + 100 * p.decode.total)


def test_prefill_terms() -> None:
    p = predict(model("gemma3"), machine(), Workload(prompt_tokens=10, output_tokens=1))
    # products: 2 x 10 rows x params / OP/s of the type, per layer
    per_layer = (2 * 10 * (64 * 64 + 16 * 64 * 2 + 64 * 64 + 64 * 128) / 100e9
                 + 2 * 10 * (128 * 64 * 2) / 200e9)
    assert p.prefill.matmul == pytest.approx(2 * per_layer)
    # attention: every (query, key) pair of the chunk, masked after: 10 x 10 x 256 FLOP
    assert p.prefill.attention == pytest.approx(2 * 10 * 10 * 256 / 100e9)
    # element-wise per row and layer: 4 x 64 norm + (4 + 1) x 16 RoPE + 128 GeGLU at 2 ns
    assert p.prefill.row_ops == pytest.approx(10 * 2 * (256 + 80 + 256) * NS)
    out = 1000 * US + 1000 * NS + 5 * US
    overhead = 200 * US + 2 * 20 * US + 10 * 20 * NS + 1000 * NS
    assert p.prefill.first_token == pytest.approx(out + overhead)
    assert p.ttft == pytest.approx(p.prefill.total)
    assert sum(p.prefill.shares().values()) == pytest.approx(1)


def test_product_calls_follow_kvlabs_joined_matrices() -> None:
    assert product_calls(layer().matrices) == 4
    assert product_calls(layer(qkv=("Q5_0", "Q5_0", "Q8_0")).matrices) == 5  # Gemma 3 270M
    assert product_calls(layer(qkv=("Q5_0", "Q8_0", "Q5_0")).matrices) == 6
    assert DecodeTerms(1, 2, 1).shares() == {"weights": 0.25, "KV": 0.5, "overhead": 0.25}


def test_matrices_are_counted_as_the_loader_holds_them() -> None:
    assert loaded_matrix(MatrixSpec("Q4_0", 64, 64, 18_000)) == \
        MatrixSpec("Q8_0x8", 64, 64, 34_000)  # widened to 8 bits
    assert loaded_matrix(MatrixSpec("Q5_0", 64, 64, 22_000)) == \
        MatrixSpec("Q5_0x8", 64, 64, 22_000)  # the file's size
    assert loaded_matrix(MatrixSpec("Q6_K", 8, 256, 210)).nbytes == 210  # the file's size
    assert loaded_matrix(MatrixSpec("Q4_K", 8, 256, 144, "ffn_down")).qtype == "Q4_Kx8"
    for qtype, size in (("Q5_K", 176), ("Q3_K", 110), ("IQ4_XS", 136)):  # the file's size
        assert loaded_matrix(MatrixSpec(qtype, 8, 256, size)) == \
            MatrixSpec(f"{qtype}x8", 8, 256, size)
    for kept in (MatrixSpec("Q5_0", 12, 64, 1), MatrixSpec("F32", 8, 8, 256),
                 MatrixSpec("Q5_1", 8, 256, 192)):  # 12 rows; no grouped kernel for these
        assert loaded_matrix(kept) == kept


def test_what_the_model_needs() -> None:
    assert unsupported_reason(model(), machine()) is None
    part = HardwareSpec.from_name("rtx-4090")
    assert "kvlab probe" in str(unsupported_reason(model(), part))
    described = spec_from_description(params=8e9, bits=4.5)
    assert "GGUF" in str(unsupported_reason(described, machine()))
    with pytest.raises(KvlabError, match="one sequence at a time"):
        predict(model(), machine(), Workload(concurrency=2))
    with pytest.raises(KvlabError, match="kvlab probe"):
        predict(model(), part, Workload())


def test_unmeasured_types_and_families_fall_back_to_the_slowest() -> None:
    k = rates()
    assert k.weight_rate("Q6_K") == 10e9 and k.prefill_rate("Q6_K") == 100e9
    assert k.engine("qwen3") == k.engine("llama")
    assert k.engine("gemma2") == (200 * US, 20 * US, 20 * NS)
    only_llama = rates(step_seconds={"llama": 1.0}, layer_seconds={"llama": 2.0},
                       position_seconds={"llama": 3.0})
    assert only_llama.engine("gemma3") == (1.0, 2.0, 3.0)


# -- kvlab bench --estimate ------------------------------------------------------------------


def _result(test: str, n_prompt: int, n_gen: int, depth: int, tok_s: float,
            samples: tuple[float, ...] = ()) -> BenchResult:
    samples = samples or (tok_s,)
    std = (max(samples) - min(samples)) / 2
    return BenchResult(test, n_prompt, n_gen, depth, tok_s, std, samples, 0.0, 0.0, 0.0, None)


def test_bench_rows_compare_kvlab_and_roofline() -> None:
    m, hw = model(), machine()
    truth = predict(m, hw, Workload(prompt_tokens=16, output_tokens=8))
    decode = predict(m, hw, Workload(prompt_tokens=1, output_tokens=8))
    results = [_result("pp16", 16, 0, 0, truth.prefill_tok_s),
               _result("tg8", 0, 8, 0, decode.decode_tok_s / 2)]
    rows = bench_check.kvlab_rows(m, hw, results)
    names = [r.figure for r in rows]
    assert names == ["pp16 prefill tok/s", "TTFT, 16-token prompt (s)", "tg8 decode tok/s",
                     "response, 16 in + 8 out (s)"]
    assert rows[0].error == pytest.approx(0) and not rows[0].miss
    assert rows[2].error == pytest.approx(-50) and "weights" in rows[2].terms
    assert "the products read weights at" in rows[2].miss
    assert all(r.roofline > 0 for r in rows)


def test_print_check(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                     ) -> None:
    m, hw = model(), machine()
    monkeypatch.setattr(bench_estimate, "_hardware", lambda threads, *_: hw)
    monkeypatch.setattr(bench_estimate, "bench_model", lambda path: m)
    tok_s = predict(m, hw, Workload(prompt_tokens=1, output_tokens=8)).decode_tok_s
    results = [_result("tg8", 0, 8, 0, tok_s, samples=(tok_s * 0.7, tok_s * 1.3))]
    bench_estimate.print_check("model.gguf", results, 2, quantized=True)
    out = capsys.readouterr().out
    assert "tg8 decode tok/s" in out and "+0.0%" in out
    assert "where the predicted time goes" in out and "every figure within 25%" in out
    assert "tg8: its runs spread" in out and "not modelled" in out
    bench_estimate.print_check("model.gguf", results, 2, quantized=False)  # dequantized run
    assert "step model does not apply" in capsys.readouterr().out


def test_bench_reprobes_a_cache_without_kernel_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    old = {"bandwidth_gbs": 20.0, "tflops": {"fp32": 0.5}, "memory_gib": 16.0, "threads": 2,
           "cpu": "Old CPU", "measured_at": "2025-01-02T03:04:05+00:00", "details": {},
           "version": 1}
    (tmp_path / "probe.json").write_text(json.dumps(old))
    fresh = ProbeResult(**{**old, "version": PROBE_VERSION,
                           "cpu": "New CPU", "kernels": asdict(rates())})
    calls = []
    monkeypatch.setattr(bench_estimate, "probe",
                        lambda threads, **_: calls.append(threads) or fresh)
    hw = bench_estimate._hardware(2)
    assert calls == [2] and hw.kernels == rates() and "New CPU" in hw.name
    assert "has no kernel figures" in capsys.readouterr().out
    assert bench_estimate._hardware(2).kernels == rates() and calls == [2]  # cached now
    bench_estimate._hardware(4)  # another thread count: probed again
    assert calls == [2, 4] and "is for 2 threads" in capsys.readouterr().out
    older = {**old, "version": 2, "kernels": asdict(rates())}  # before the Q8_0x8 figures
    (tmp_path / "probe.json").write_text(json.dumps(older))
    bench_estimate._hardware(2)
    assert calls == [2, 4, 2] and "older kvlab (version 2)" in capsys.readouterr().out


# -- kvlab estimate --engine kvlab ---------------------------------------------------------


def test_estimate_engine_kvlab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    from test_estimate_cli import run_cli


    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path))
    save_probe(ProbeResult(bandwidth_gbs=20.0, tflops={"fp32": 0.5}, memory_gib=16.0,
                           threads=2, cpu="Test CPU", measured_at="2025-01-02T03:04:05+00:00",
                           kernels=asdict(rates())))
    gguf = tmp_path / "tiny.gguf"
    write_synthetic_gguf(gguf, "gemma3", 2, SyntheticShape(64, 128, 4, 1, 32, 16))
    assert run_cli(["estimate", str(gguf), "--engine", "kvlab", "--prompt", "64",
                    "--output", "16"]) == 0
    out = capsys.readouterr().out
    assert "kvlab's own engine here" in out and "tok/s, a" in out
    assert run_cli(["estimate", str(gguf), "--engine", "kvlab", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kvlab"]["decode_tok_s"] > 0 and data["hardware"]["kernels"]["threads"] == 2
    with pytest.raises(KvlabError, match="kvlab probe"):  # a named part has no kernel figures
        run_cli(["estimate", str(gguf), "--engine", "kvlab", "--hardware", "rtx-4090"])


def test_notes_name_a_bias_shared_by_every_decode_figure() -> None:
    def row(figure: str, measured: float) -> bench_check.CheckRow:
        return bench_check.CheckRow(figure, 100.0, measured, 150.0, "", "")

    slower = [row("tg64 decode tok/s", 94), row("tg64@d1024 decode tok/s", 91),
              row("pp512 prefill tok/s", 120)]
    notes = bench_check.notes([], slower)
    assert any("all 2 figures below the prediction (-9 to -6 %)" in n for n in notes)
    mixed = [row("tg64 decode tok/s", 94), row("tg64@d1024 decode tok/s", 104)]
    assert not any("all 2 figures" in n for n in bench_check.notes([], mixed))
