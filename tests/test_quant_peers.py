"""bench/quant_peers.py's choice of how a quant type's file is made, against a stand-in
llama-quantize that has no --dry-run (older llama.cpp builds): a mix that needs no imatrix
is quantized, with or without --random-blocks; one that needs an imatrix is refused."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import quant_peers
from planned_gguf import QuantizeFailed

# llama.cpp's vocabulary files: the folder `make test` unpacks and names in KVLAB_LLAMA_VOCABS
VOCAB = Path(os.environ.get("KVLAB_LLAMA_VOCABS", "/nonexistent")) / "ggml-vocab-llama-bpe.gguf"

# llama-quantize without --dry-run: refuses it; else writes its output (argument 2)
NO_DRY_RUN = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
case "$1" in --dry-run) echo "error: unknown argument: --dry-run" >&2; exit 1;; esac
touch "$2"
"""


def setup(tmp_path: Path, random_blocks: bool) -> argparse.Namespace:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "llama-quantize"
    tool.write_text(NO_DRY_RUN)
    tool.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    (work / quant_peers.F16_NAME).write_bytes(b"")  # the F16 file, made already
    return argparse.Namespace(workdir=work, vocab=VOCAB, llama_bin=bin_dir,
                              random_blocks=random_blocks)


def calls(args: argparse.Namespace) -> list[str]:
    return (args.llama_bin / "calls").read_text().splitlines()


def test_a_mix_without_imatrix_is_quantized_without_a_dry_run(tmp_path):
    args = setup(tmp_path, random_blocks=False)
    out = quant_peers.quantized(args, "Q4_K_M")
    assert out.exists() and out.name == quant_peers.F16_NAME.replace("F16", "Q4_K_M")
    assert not any("--dry-run" in c for c in calls(args))


@pytest.mark.skipif(not VOCAB.exists(), reason=f"no Llama vocabulary GGUF at {VOCAB} (set KVLAB_LLAMA_VOCABS)")
def test_random_blocks_fall_back_to_quantizing_where_the_dry_run_fails(tmp_path):
    args = setup(tmp_path, random_blocks=True)
    assert quant_peers.quantized(args, "Q4_K_M").exists()
    assert ["--dry-run" in c for c in calls(args)] == [True, False]
    with pytest.raises(QuantizeFailed):
        quant_peers.quantized(args, "IQ2_XXS")
