"""``benchmarks/bench_peers.py`` and ``benchmarks/llamacpp.py`` without llama.cpp's binaries.

What the peer table's honesty rests on and can be checked in a second (the GGUF round trip is
``test_bench_llamacpp.py``'s): the calibration text
handed to ``llama-imatrix`` is the token stream attnquant calibrates on; bytes are counted
from what the checkpoints store.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_peers  # noqa: E402
from bench_quality import CALIBRATION, DEMO  # noqa: E402

from attnquant_core import DecomposeSpec, decompose_checkpoint  # noqa: E402
from attnquant_core.calib import open_source, read_texts, token_stream  # noqa: E402


def test_imatrix_text_is_the_calibration_stream() -> None:
    """The text written for ``llama-imatrix`` (documents joined by the EOS and BOS tokens,
    BOS left to llama.cpp) encodes, specials parsed and BOS added, to ``token_stream``'s ids."""
    from tokenizers import Tokenizer

    config = json.loads((DEMO / "config.json").read_text())
    texts = read_texts([CALIBRATION])
    stream = token_stream(DEMO, texts, config)
    joined = bench_peers.llama_text(DEMO, texts, config)
    ids = Tokenizer.from_file(str(DEMO / "tokenizer.json")).encode(joined).ids
    assert np.array_equal(np.asarray(ids), stream)


def test_bytes_counted_from_the_stored_tensors(tmp_path: Path) -> None:
    """A passthrough NVFP4 checkpoint: the projections' bytes are the manifest's stored bytes;
    the 4-bit head row counts the head at 4.5 bits a weight."""
    out = tmp_path / "nvfp4"
    manifest = decompose_checkpoint(DEMO, out, spec=DecomposeSpec(quant="nvfp4", rank=0))
    row = bench_peers.theta_row("nvfp4", "", out, 0.0)
    stored = sum(f["stored_bytes"] for f in manifest["families"].values())
    assert row.projection_bytes == stored
    head = row.sizes[bench_peers.HEAD]
    assert head == 2048 * 192 * 4
    quant = bench_peers.with_nvfp4_head(row)
    assert quant.sizes[bench_peers.HEAD] == 2048 * 192 * 9 // 16 + 4
    assert quant.projection_bytes == row.projection_bytes
    W = quant.source.get(bench_peers.HEAD)
    assert W.shape == (2048, 192) and not np.array_equal(W, open_source(out).get(bench_peers.HEAD))
