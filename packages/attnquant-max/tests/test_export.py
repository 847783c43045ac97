"""MAX reads ``export_nvfp4``'s output as a modelopt NVFP4 checkpoint.

The writer (numpy) lives in attnquant-core and is tested there (``test_modelopt_export.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnquant_core.io import ExportProgress, export_nvfp4
from attnquant_core.testing import (
    EXPORT_LAYERS,
    EXPORT_SHAPES,
    export_source_tensors,
    write_checkpoint,
)

LAYERS, SHAPES = EXPORT_LAYERS, EXPORT_SHAPES


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("src") / "dense", export_source_tensors())


@pytest.fixture(scope="module")
def exported(dense: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("out") / "nvfp4"
    events: list[ExportProgress] = []
    summary = export_nvfp4(dense, out, progress=events.append)
    summary["_events"] = events
    return out, summary


def test_max_reads_the_export_as_nvfp4(exported):
    """MAX 26.7 parses the config as modelopt NVFP4 and its NVFP4 ``Linear`` loads every projection.

    Host-side only (no graph is compiled): the FP4 matmul itself needs a Blackwell GPU.
    """
    pytest.importorskip("max.pipelines")
    from types import SimpleNamespace

    from max.dtype import DType
    from max.graph import DeviceRef
    from max.graph.weights import SafetensorWeights
    from max.nn.linear import Linear
    from max.pipelines.weights.quant import parse_quant_config

    out, _ = exported
    weights = SafetensorWeights(sorted(out.glob("*.safetensors")))
    state = {key: w.data() for key, w in weights.items()}
    config = SimpleNamespace(**json.loads((out / "config.json").read_text()))
    config.num_hidden_layers = LAYERS
    quant = parse_quant_config(config, state, DType.uint8, state_dict_name_prefix="model.")
    assert quant is not None and quant.is_nvfp4 and quant.is_static
    assert quant.mlp_quantized_layers == quant.attn_quantized_layers == set(range(LAYERS))
    for layer in range(LAYERS):
        for family, (out_dim, in_dim) in SHAPES.items():
            prefix = f"model.layers.{layer}.{family}"
            linear = Linear(
                in_dim, out_dim, DType.bfloat16, DeviceRef.CPU(), quant_config=quant, name=prefix
            )
            mine = {k: v for k, v in state.items() if k.startswith(prefix + ".")}
            assert set(mine) == set(linear.raw_state_dict())
            linear.load_state_dict(mine, strict=True)
