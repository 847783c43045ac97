"""What each row of ``benchmarks/bench_compressed.py`` serves: its checkpoint and config.

A suffix names the same weights served another way ("+head": the head in NVFP4; "+emb": the
embedding table too; "row-major",
"per-member": a layout or dispatch switch turned off; "int8": int8 activations turned on), so a suffix must reach every row it
can follow, a budget row's too. No checkpoint is written: the budget and NVFP4 + r16 rows find
theirs already in the work folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from attnquant_core.serving import ServingOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_compressed


@pytest.fixture
def work(tmp_path: Path) -> Path:
    for name in ("budget_0.5", "nvfp4_r16"):
        (tmp_path / name).mkdir()
    return tmp_path


@pytest.mark.parametrize(
    ("variant", "path", "overrides"),
    [
        ("budget 0.5", "budget_0.5", {"path": "gemm"}),
        ("float32", "base", {"path": "precompute-outside"}),
        ("float32 custom-op", "base", {"path": "custom-op"}),
        ("budget 0.5 custom-op", "budget_0.5", {"path": "custom-op"}),
        (
            "budget 0.5 custom-op+head",
            "budget_0.5",
            {"path": "custom-op", "quant_head": True, "nvfp4_kernel": "fused"},
        ),
        (
            "nvfp4",
            "base",
            {"path": "precompute-outside", "quant": "nvfp4", "nvfp4_kernel": "fused"},
        ),
        (
            "nvfp4+head per-member",
            "base",
            {
                "path": "precompute-outside",
                "quant": "nvfp4",
                "nvfp4_kernel": "fused",
                "quant_head": True,
                "nvfp4_merge": False,
            },
        ),
        (
            "nvfp4+head float",
            "base",
            {
                "path": "precompute-outside",
                "quant": "nvfp4",
                "nvfp4_kernel": "fused",
                "quant_head": True,
                "nvfp4_int8": False,
            },
        ),
        (
            "nvfp4+head+emb float",
            "base",
            {
                "path": "precompute-outside",
                "quant": "nvfp4",
                "nvfp4_kernel": "fused",
                "quant_head": True,
                "quant_embedding": True,
                "nvfp4_int8": False,
            },
        ),
        (
            "nvfp4+r16 row-major",
            "nvfp4_r16",
            {"path": "in-graph", "nvfp4_kernel": "fused", "nvfp4_tiled": False},
        ),
    ],
)
def test_every_variant_serves_its_checkpoint_and_config(
    work: Path, variant: str, path: str, overrides: dict
) -> None:
    assert variant in bench_compressed.VARIANTS
    base = work / "base"
    got_path, got, how = bench_compressed.prepare(variant, base, work, shape=None)
    assert got_path == (base if path == "base" else work / path)
    assert got == overrides
    ServingOptions(**got)  # every override is a serving option
    if "+head" in variant:
        assert "head NVFP4 too" in how
    assert ("embedding NVFP4 too" in how) == ("+emb" in variant)
    for suffix, (_, _, said) in bench_compressed.LAYOUT_SUFFIXES.items():
        assert (said in how) == variant.endswith(suffix)


def test_head_bytes_count_a_suffixed_head_variant() -> None:
    """The roofline's head bytes: NVFP4 for every "+head" row, a suffix after it too."""
    from synthetic_llama import SHAPES

    shape = SHAPES["300m"]
    nvfp4_head = shape.vocab * shape.hidden * 9 / 16 + 4
    for variant in ("nvfp4+head", "nvfp4+head per-member", "budget 0.5 custom-op+head"):
        assert bench_compressed._head_bytes(shape, variant) == nvfp4_head
    assert bench_compressed._head_bytes(shape, "nvfp4") == shape.vocab * shape.hidden * 4


@pytest.mark.parametrize("shape_name", ["300m", "1b"])
def test_table_bytes_of_an_nvfp4_embedding(shape_name: str) -> None:
    """ "+emb": the table in NVFP4; an untied head beside it, a tied one the table itself (held
    once, streamed whole by each decode step)."""
    from synthetic_llama import SHAPES

    shape = SHAPES[shape_name]
    nvfp4 = shape.vocab * shape.hidden * 9 / 16 + 4
    assert bench_compressed._table_bytes(shape, "nvfp4+head+emb") == nvfp4
    head = bench_compressed._head_bytes(shape, "nvfp4+head+emb")
    assert head == (None if shape.tie_embeddings else nvfp4)
    held = 10**9
    streamed = bench_compressed.streamed_bytes(held, shape, "nvfp4+head+emb")
    assert streamed == (
        held if shape.tie_embeddings else held - int(nvfp4) + int(nvfp4 / shape.vocab)
    )


def test_a_checkpoint_on_disk_is_a_shape_with_its_own_config() -> None:
    """``bench_compressed --model DIR`` (a real model): its dimensions and config.json, so the
    byte counts and the llama.cpp rows' numpy scoring use the model's own values."""
    import json

    from synthetic_llama import projection_shapes, shape_of

    from attnquant_cli import demo_model_path

    demo = demo_model_path()
    cfg = json.loads((demo / "config.json").read_text())
    shape = shape_of(demo)
    assert (shape.hidden, shape.layers, shape.vocab) == (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["vocab_size"],
    )
    assert shape.config() == cfg
    proj, _ = shape.parameters()
    q, h = projection_shapes(shape)["self_attn.q_proj"]
    assert q == h == cfg["hidden_size"] and proj > 0
