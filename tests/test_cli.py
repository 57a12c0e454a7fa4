"""The command line as a user meets it: real subprocesses, one clear line and exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tiny_models import build


def kvlab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab.cli.main", *args], check=False,
                          capture_output=True, text=True, timeout=timeout)


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    build("qwen2", out)
    return out / "model.gguf"


def test_missing_file(tmp_path):
    assert_user_error(kvlab("run", "--model", str(tmp_path / "nope.gguf"), "hi"), "not found")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip file, not a model")
    assert_user_error(kvlab("info", str(bad)), "not a GGUF file")


def test_truncated_file(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    assert_user_error(kvlab("info", str(cut)), "truncated")


def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_user_error(kvlab("info", str(path)), "'mamba' is not supported", "gemma3")


def test_unsupported_quant_type(tmp_path):
    import gguf

    path = tmp_path / "iq1s.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("embedding_length", 256), ("context_length", 64),
                       ("feed_forward_length", 512), ("attention.head_count", 4)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_uint32("llama.vocab_size", 8)
    iq1 = gguf.GGMLQuantizationType.IQ1_S  # 256 weights in 50 bytes
    w.add_tensor("token_embd.weight", np.zeros((8, 50), dtype=np.uint8), raw_dtype=iq1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_user_error(kvlab("info", str(path)), "IQ1_S is not supported", "Q4_K")


def test_invalid_sampling_values(tiny_gguf):
    assert_user_error(kvlab("run", "--model", str(tiny_gguf), "--top-p", "1.5", "hi"),
                      "top_p must be in (0, 1]")
    assert_user_error(kvlab("run", "--model", str(tiny_gguf), "--temperature", "-1", "hi"),
                      "temperature")


def test_prompt_longer_than_context(tiny_gguf):
    proc = kvlab("run", "--model", str(tiny_gguf), "-n", "4", "word " * 400)
    assert_user_error(proc, "exceeds the context length 256")


def test_info_and_json_run_on_tiny_model(tiny_gguf):
    info = json.loads(kvlab("info", str(tiny_gguf), "--json").stdout)
    assert info["architecture"] == "qwen2" and info["layers"] == 3
    assert info["kv_bytes_per_token_f16"] == 2 * 3 * 2 * 16 * 2
    proc = kvlab("run", "--model", str(tiny_gguf), "-n", "5", "--ignore-eos", "--json", "ab")
    record = json.loads(proc.stdout)
    assert record["metrics"]["output_tokens"] == 5
    assert record["finish_reason"] == "length"
    assert record["logprobs"] is None  # not asked for


def test_json_run_reports_the_logprobs_asked_for(tiny_gguf):
    proc = kvlab("run", "--model", str(tiny_gguf), "-n", "4", "--ignore-eos", "--json",
                 "--logprobs", "3", "ab")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    lp = record["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == record["text"]
    assert lp["text_offset"][0] == 0
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and 1 <= len(top) <= 4  # the top 3 and the chosen token
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen one is first


def test_logprobs_without_a_record_for_them_are_refused(tiny_gguf):
    for command in (("run", "--logprobs", "2", "ab"), ("chat", "--logprobs", "2")):
        proc = kvlab(*command[:1], "--model", str(tiny_gguf), *command[1:])
        assert proc.returncode == 2 and "--logprobs" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_run_default_model_streams_text_and_metrics():
    proc = kvlab("run", "-n", "16", "--threads", "2", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout or len(proc.stdout.split()) > 5
    for label in ("TTFT", "prefill", "decode", "ITL", "KV cache", "GB/s", "GFLOP/s"):
        assert label in proc.stderr


def test_bench_json_on_tiny_model(tiny_gguf):
    proc = kvlab("bench", "-m", str(tiny_gguf), "-p", "16", "-n", "4", "-r", "2", "-d", "0,8",
                 "-o", "json")
    assert proc.returncode == 0, proc.stderr
    results = {r["test"]: r for r in json.loads(proc.stdout)["results"]}
    assert set(results) == {"pp16", "tg4", "tg4@d8"}
    assert all(r["tok_s_mean"] > 0 and len(r["samples"]) == 2 for r in results.values())
    assert results["tg4@d8"]["bytes_per_token"] > results["tg4"]["bytes_per_token"]


def test_kv_quality_on_tiny_model(tiny_gguf):
    proc = kvlab("kv-quality", "--model", str(tiny_gguf), "--positions", "20",
                 "--compare", "f16,bf16")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["f16", "bf16"]
    assert all(float(r[3]) < 1e-2 for r in rows)  # mean KL in nats
    assert_user_error(kvlab("kv-quality", "--model", str(tiny_gguf), "--compare", "f8"),
                      "--compare takes")


def test_chat_two_turns_on_tiny_model(tiny_gguf):
    proc = subprocess.run([sys.executable, "-m", "kvlab.cli.main", "chat", "--model",
                           str(tiny_gguf), "-n", "4", "--ignore-eos", "--metrics"],
                          input="hello there\nand again\n\n", capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") >= 3  # two answered turns, then the empty line ends it
    assert proc.stderr.count("TTFT") == 2
