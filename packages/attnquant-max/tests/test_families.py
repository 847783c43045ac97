"""Mistral, Qwen2 and Qwen3 text through attnquant-max, without building a MAX graph.

Mistral is served by attnquant's Llama architecture under Mistral's name (every path); Qwen2
by MAX's own graph, float32 on a CPU, theta rebuilt at load (precompute-outside); Qwen3 by
MAX's own graph on a GPU (on a CPU it crashes, so it is refused there in one line).
Checked here: what our architectures hand MAX (bit for bit what the stock adapter makes of the
dense checkpoint, and of a banded fit rebuilt by core), the one-line refusals (the in-graph
paths on Qwen, a sliding window past the served length). The compiled checks against the numpy
reference are in test_families_graph.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from attnquant_core import ThetaCheckpoint, decompose_checkpoint, open_checkpoint
from attnquant_max import ServingOptions, plan_serving
from attnquant_max._config import DeviceError, require_device
from attnquant_max.testing import FAMILY_CONFIGS, write_tiny_family

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FAMILIES = tuple(FAMILY_CONFIGS)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: write_tiny_family(root / name / "dense", name) for name in FAMILIES}


@pytest.fixture(scope="module")
def archs() -> dict[str, Any]:
    from attnquant_max.architectures import build_architectures

    return {arch.name: arch for arch in build_architectures()}


def _adapt(adapter: Any, path: Path) -> dict[str, Any]:
    """What ``adapter`` makes of the checkpoint at ``path``, as MAX's load calls it."""
    from max.graph.weights import load_weights
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path)
    pipeline_config = SimpleNamespace(
        model=SimpleNamespace(
            model_path=str(path),
            huggingface_config=hf_config,
            quantization_encoding="float32",
            _resolved_dtype_cast=(None, None),
        )
    )
    weights = load_weights(sorted(path.glob("*.safetensors")))
    return adapter(
        dict(weights.items()), huggingface_config=hf_config, pipeline_config=pipeline_config
    )


def _arrays(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.from_dlpack(getattr(v, "data", v)).copy() for k, v in state.items()}


def _stock() -> Any:
    """The stock adapter of all three: Llama's (MAX's Qwen2 and Qwen3 use it too)."""
    from max.pipelines.architectures.llama3 import weight_adapters

    return weight_adapters.convert_safetensor_state_dict


def test_the_families_are_registered_and_run_in_float32(archs: dict[str, Any]) -> None:
    from max.graph.weights import WeightsFormat

    from attnquant_max._adapter import ThetaWeightAdapter

    for name in FAMILIES:
        assert "float32" in archs[name].supported_encodings, name
        adapter = archs[name].weight_adapters[WeightsFormat.safetensors]
        assert isinstance(adapter, ThetaWeightAdapter), name
    assert archs["MistralForCausalLM"].pipeline_model is archs["LlamaForCausalLM"].pipeline_model
    assert archs["Qwen3ForCausalLM"].pipeline_model.__name__ == "Qwen3Model"  # MAX's own


@pytest.mark.parametrize("name", FAMILIES)
def test_dense_and_banded_hand_max_what_the_stock_adapter_makes(
    name: str, archs: dict[str, Any], dense: dict[str, Path], tmp_path: Path
) -> None:
    from max.graph.weights import WeightsFormat

    ours = dataclasses.replace(  # the stock graph: rebuilt at load, Mistral's in-graph aside
        archs[name].weight_adapters[WeightsFormat.safetensors],
        options=ServingOptions(path="precompute-outside"),
    )
    stock = _arrays(_adapt(_stock(), dense[name]))
    assert any(k.endswith("bias") for k in stock) == (name == "Qwen2ForCausalLM")
    assert any(k.endswith("q_norm.weight") for k in stock) == (name == "Qwen3ForCausalLM")
    served = _arrays(_adapt(ours, dense[name]))
    assert sorted(served) == sorted(stock)
    for key in stock:
        assert served[key].tobytes() == stock[key].tobytes(), key
    banded = tmp_path / "g1"  # one W0 shared by both layers, a rank-4 correction each
    decompose_checkpoint(dense[name], banded, blocks=1, rank=4)
    served = _arrays(_adapt(ours, banded))
    assert sorted(served) == sorted(stock)  # biases and q/k norms travel with the fit
    theta = ThetaCheckpoint.open(banded)
    for family in theta.families:
        for layer in range(theta.num_layers):
            key = f"layers.{layer}.{family}.weight"
            np.testing.assert_array_equal(served[key], theta.rebuild(family, layer), err_msg=key)
            assert not np.array_equal(served[key], stock[key]), key  # a fit, not the weight


def test_qwen_in_the_graph_is_refused_in_one_line(
    archs: dict[str, Any], dense: dict[str, Path], tmp_path: Path
) -> None:
    from max.graph.weights import WeightsFormat

    theta = tmp_path / "qwen3-g1"
    decompose_checkpoint(dense["Qwen3ForCausalLM"], theta, blocks=1, rank=4)
    plan = plan_serving(theta, ServingOptions())  # auto: the stock graph, and why
    assert plan.path == "precompute-outside"
    assert "Qwen3ForCausalLM" in " ".join(plan.reason.split())
    adapter = archs["Qwen3ForCausalLM"].weight_adapters[WeightsFormat.safetensors]
    asked = dataclasses.replace(adapter, options=ServingOptions(path="gemm"))
    with pytest.raises(NotImplementedError) as info:
        _adapt(asked, theta)
    message = str(info.value)
    assert "\n" not in message and "precompute-outside" in message
    assert "MistralForCausalLM" in message  # the architectures that are served in the graph


def _with_config(path: Path, **fields: Any) -> Path:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    return path


def test_a_sliding_window_past_the_served_length_is_refused(tmp_path: Path) -> None:
    mistral = _with_config(
        write_tiny_family(tmp_path / "mistral", "MistralForCausalLM"), sliding_window=128
    )
    require_device(mistral, "cpu", max_length=128)  # full attention is exact up to the window
    with pytest.raises(DeviceError) as info:
        require_device(mistral, "cpu", max_length=512)
    message = str(info.value)
    assert "\n" not in message and "sliding_window 128" in message
    assert "--max-length 128 or less" in message
    with pytest.raises(DeviceError, match="asked: 256"):  # unset: max_position_embeddings
        require_device(mistral, "cpu")
    qwen = write_tiny_family(tmp_path / "qwen2", "Qwen2ForCausalLM")
    _with_config(qwen, sliding_window=64)  # use_sliding_window false: full attention
    require_device(qwen, "cpu", max_length=512)
    _with_config(qwen, use_sliding_window=True)
    with pytest.raises(DeviceError, match="Qwen2ForCausalLM with sliding_window 64"):
        require_device(qwen, "cpu", max_length=512)


def test_the_reference_reads_the_families(dense: dict[str, Path]) -> None:
    """The numpy reference the compiled test compares with sees the biases and q/k norms."""
    from attnquant_core.llama_reference import llama_logits

    ids = [256, 72, 101, 108, 108, 111]
    logits = {}
    for name, path in dense.items():
        ckpt = open_checkpoint(path)
        logits[name] = llama_logits(ckpt.config, {k: ckpt.get(k) for k in ckpt.keys()}, ids)
    # Same projections, so Mistral is the tiny Llama; the biases and norms change the output.
    assert not np.allclose(logits["Qwen2ForCausalLM"], logits["MistralForCausalLM"], atol=1e-3)
    assert not np.allclose(logits["Qwen3ForCausalLM"], logits["MistralForCausalLM"], atol=1e-3)


def test_qwen3_on_a_cpu_is_refused_in_one_line(dense: dict[str, Path]) -> None:
    """MAX's Qwen3 pipeline model allocates allreduce signal buffers on any device; on a CPU
    that crashes the process, so attnquant refuses first. If a MAX release drops the mixin,
    this fails and the refusal can go."""
    from max.pipelines.architectures.qwen3 import Qwen3Model
    from max.pipelines.lib.interfaces.pipeline_model import AlwaysSignalBuffersMixin

    from attnquant_max import load_pipeline, serve_command

    assert issubclass(Qwen3Model, AlwaysSignalBuffersMixin)
    path = dense["Qwen3ForCausalLM"]
    for call in (lambda: require_device(path, "cpu"), lambda: load_pipeline(path, max_length=64)):
        with pytest.raises(DeviceError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and "Qwen3ForCausalLM needs a GPU" in message
        assert "signal buffers" in message and "--forward numpy" in message
    assert "--devices" in serve_command(path, port=8000, devices="gpu")
