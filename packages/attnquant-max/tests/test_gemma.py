"""Gemma 3 and Gemma 4 through attnquant-max on the CPU, without building a MAX graph.

What runs here is everything before the graph: the weights our architectures hand MAX
(compared, key for key and bit for bit, with what the stock adapters make of the dense
checkpoint: MAX's for the multimodal models, Llama's for attnquant's own Gemma 3 text
architecture), the refusals of broken theta checkpoints, and the plain "needs a GPU" error a
CPU user gets for the models MAX 26.7 serves on a GPU only (Gemma 3 multimodal, Gemma 4). No
graph is built or compiled (tests/test_gemma3_max.py compiles Gemma 3's), nothing is
downloaded.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from attnquant_core import (
    BandMismatchError,
    ThetaCheckpoint,
    ThetaFormatError,
    decompose_checkpoint,
    parse_projection_key,
    rebuild_dense_state,
)
from attnquant_core.tiny_gemma import (
    write_tiny_gemma3,
    write_tiny_gemma3_conditional,
    write_tiny_gemma4,
)
from attnquant_max import ServingOptions, WeightKeyError, plan_serving
from attnquant_max._config import GPU_ONLY_ARCHITECTURES, DeviceError, require_device

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ARCHS = [
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration",
]
WRITERS: dict[str, Callable[..., Path]] = {
    "Gemma3ForCausalLM": write_tiny_gemma3,
    "Gemma3ForConditionalGeneration": write_tiny_gemma3_conditional,
    # Uniform layers: core decomposes them (the 31B shape is checked at passthrough below).
    "Gemma4ForConditionalGeneration": lambda path: write_tiny_gemma4(
        path, global_head_dim=16, num_global_key_value_heads=None, attention_k_eq_v=False
    ),
}


def _write_gemma4_unified(path: Path) -> Path:
    """Gemma 4 12B's layout ("gemma4_unified"): Gemma 4's keys under another config type."""
    path = WRITERS["Gemma4ForConditionalGeneration"](path)
    config = json.loads((path / "config.json").read_text())
    config.update(
        architectures=["Gemma4UnifiedForConditionalGeneration"], model_type="gemma4_unified"
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


WRITERS["Gemma4UnifiedForConditionalGeneration"] = _write_gemma4_unified
STACKS = {
    "Gemma4UnifiedForConditionalGeneration": "model.language_model.layers",
    "Gemma3ForCausalLM": "model.layers",
    "Gemma3ForConditionalGeneration": "language_model.model.layers",
    "Gemma4ForConditionalGeneration": "model.language_model.layers",
}


@pytest.fixture(scope="module")
def max_archs() -> dict[str, Any]:
    from attnquant_max.architectures import build_architectures

    return {arch.name: arch for arch in build_architectures()}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    return {name: WRITERS[name](root / name / "dense") for name in ARCHS}


@pytest.fixture(scope="module")
def passthrough(dense: dict[str, Path]) -> dict[str, Path]:
    out = {}
    for name, path in dense.items():
        out[name] = path.parent / "theta_passthrough"
        decompose_checkpoint(path, out[name], blocks="layers", rank=0)
    return out


@pytest.fixture(scope="module")
def banded(dense: dict[str, Path]) -> dict[str, Path]:
    out = {}
    for name, path in dense.items():
        out[name] = path.parent / "theta_g2"
        decompose_checkpoint(path, out[name], blocks=2, rank=4)
    return out


# -- what MAX is handed ---------------------------------------------------------------------


def _weights(path: Path) -> Any:
    from max.graph.weights import load_weights

    return load_weights(sorted(path.glob("*.safetensors")))


def _hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _pipeline_config(path: Path) -> SimpleNamespace:
    """The part of MAX's ``PipelineConfig`` a load reads: the path, the Hugging Face config, and
    (for Llama's adapter) an encoding resolved with no cast (weights handed over as stored)."""
    return SimpleNamespace(
        model=SimpleNamespace(
            model_path=str(path),
            huggingface_config=_hf_config(path),
            quantization_encoding="float32",
            _resolved_dtype_cast=(None, None),
        )
    )


def _raw(weight_data: Any) -> tuple[str, tuple[int, ...], bytes]:
    """dtype, shape and bytes of a MAX ``WeightData``."""
    from max.driver import Buffer
    from max.dtype import DType

    shape = tuple(int(d) for d in weight_data.shape)
    data = weight_data.data
    buffer = data if isinstance(data, Buffer) else Buffer.from_dlpack(data)
    size = int(np.prod(shape, dtype=np.int64)) * weight_data.dtype.size_in_bytes
    raw = np.from_dlpack(buffer.view(DType.uint8, [size])).tobytes()
    return str(weight_data.dtype), shape, raw


def _assert_same(ours: dict[str, Any], stock: dict[str, Any]) -> None:
    assert sorted(ours) == sorted(stock)
    for key in stock:
        assert _raw(ours[key]) == _raw(stock[key]), key


def _stock_state(name: str, max_archs: dict[str, Any], path: Path) -> dict[str, Any]:
    """What MAX 26.7's stock architecture makes of the checkpoint at ``path``."""
    if name == "Gemma3ForCausalLM":  # attnquant's own architecture: Llama's adapter
        from max.pipelines.architectures.llama3 import weight_adapters

        return weight_adapters.convert_safetensor_state_dict(
            dict(_weights(path).items()),
            huggingface_config=_hf_config(path),
            pipeline_config=_pipeline_config(path),
        )
    from max.pipelines.architectures.gemma3multimodal import Gemma3_MultiModalModel as G3
    from max.pipelines.architectures.gemma4 import Gemma3_MultiModalModel as G4

    return _load_language(G3 if name.startswith("Gemma3") else G4, path, path)


def _load_language(
    cls: type, weights_path: Path, model_path: Path, adapter: Any = None
) -> dict[str, Any]:
    """The language weights ``cls._load_state_dict`` sets, on an instance built without
    ``__init__`` (which would compile nothing but needs a device): only what the load reads,
    and the adapter MAX would hand it (ours carries the serving options)."""
    model = cls.__new__(cls)
    model.adapter = adapter
    model.weights = _weights(weights_path)
    model.pipeline_config = _pipeline_config(model_path)
    model.max_batch_size = 1
    model._load_state_dict()
    return model._language_weights_dict


def _our_state(
    name: str, max_archs: dict[str, Any], path: Path, options: ServingOptions
) -> dict[str, Any]:
    """What our architecture of the same name, bound to ``options``, hands MAX for the
    checkpoint at ``path``."""
    from max.graph.weights import WeightsFormat

    from attnquant_max.architectures import build_architectures

    arch = {a.name: a for a in build_architectures(options)}[name]
    adapter = arch.weight_adapters[WeightsFormat.safetensors]
    if name == "Gemma3ForCausalLM":
        return adapter(
            dict(_weights(path).items()),
            huggingface_config=_hf_config(path),
            pipeline_config=_pipeline_config(path),
        )
    return _load_language(arch.pipeline_model, path, path, adapter)


@pytest.mark.parametrize("name", ARCHS)
def test_passthrough_hands_max_what_the_stock_adapter_makes(
    name: str, max_archs: dict[str, Any], dense: dict[str, Path], passthrough: dict[str, Path]
) -> None:
    stock = _stock_state(name, max_archs, dense[name])
    assert stock, "the stock adapter kept nothing"
    _assert_same(
        _our_state(name, max_archs, passthrough[name], ServingOptions(path="precompute-outside")),
        stock,
    )
    _assert_same(
        _our_state(name, max_archs, dense[name], ServingOptions(path="precompute-outside")), stock
    )  # dense, unchanged
    if name.startswith("Gemma4"):  # and after MAX's q/k/v, gate/up fusion
        from max.pipelines.architectures.gemma4.weight_adapters import (
            fuse_gemma4_projection_weights,
        )

        ours = _our_state(
            name, max_archs, passthrough[name], ServingOptions(path="precompute-outside")
        )
        _assert_same(fuse_gemma4_projection_weights(ours), fuse_gemma4_projection_weights(stock))


def test_gemma4_31b_shape_at_passthrough_is_handed_over_unchanged(
    max_archs: dict[str, Any], tmp_path: Path
) -> None:
    """Global layers with their own head size and no v_proj are not taken for missing keys."""
    path = write_tiny_gemma4(tmp_path / "g4")
    name = "Gemma4ForConditionalGeneration"
    stock = _stock_state(name, max_archs, path)
    assert "layers.1.self_attn.v_proj.weight" not in stock
    _assert_same(
        _our_state(name, max_archs, path, ServingOptions(path="precompute-outside")), stock
    )


@pytest.fixture(scope="module")
def gemma4_31b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 4 31B's shape: global layers (1 and 3) with head size 32, one kv head, no v_proj."""
    return write_tiny_gemma4(tmp_path_factory.mktemp("g4_31b") / "dense")


def _projection_suffix(key: str) -> str | None:
    """``layers.3.self_attn.q_proj.weight`` from any stack's projection key."""
    parsed = parse_projection_key(key)
    return None if parsed is None else f"layers.{parsed[1]}.{parsed[2]}.weight"


def test_gemma4_31b_shape_theta_at_passthrough_is_what_the_stock_adapter_makes(
    max_archs: dict[str, Any], gemma4_31b: Path, tmp_path: Path
) -> None:
    """A theta checkpoint of the 31B shape (families grouped by layer shape, format version 3)
    is rebuilt at load into exactly the tensors MAX's stock Gemma 4 loader reads."""
    theta = tmp_path / "theta"
    manifest = decompose_checkpoint(gemma4_31b, theta, blocks="layers", rank=0)
    assert manifest["format_version"] == 3
    name = "Gemma4ForConditionalGeneration"
    stock = _stock_state(name, max_archs, gemma4_31b)
    assert "layers.1.self_attn.v_proj.weight" not in stock
    plan = plan_serving(theta, ServingOptions(path="precompute-outside"))
    assert plan.source == "theta" and plan.passthrough and plan.num_layers == 4
    _assert_same(
        _our_state(name, max_archs, theta, ServingOptions(path="precompute-outside")), stock
    )
    _assert_same(
        _our_state(
            name, max_archs, theta, ServingOptions(path="precompute-outside", blocks="layers")
        ),
        stock,
    )


@pytest.mark.parametrize("blocks", [1, 2])
def test_gemma4_31b_shape_banded_theta_hands_max_cores_rebuild(
    max_archs: dict[str, Any], gemma4_31b: Path, tmp_path: Path, blocks: int
) -> None:
    """At G < L the weights handed to MAX are core's rebuild, bit for bit, under MAX's keys."""
    theta = tmp_path / "theta"
    decompose_checkpoint(gemma4_31b, theta, blocks=blocks, rank=4)
    name = "Gemma4ForConditionalGeneration"
    stock = _stock_state(name, max_archs, gemma4_31b)
    rebuilt = dict(ThetaCheckpoint.open(theta).rebuilt_state())
    ours = _our_state(
        name, max_archs, theta, ServingOptions(path="precompute-outside", blocks=blocks)
    )
    assert (
        dict(
            plan_serving(theta, ServingOptions(path="precompute-outside", blocks=blocks)).state()
        ).keys()
        == rebuilt.keys()
    )
    assert sorted(ours) == sorted(stock)
    by_suffix = {_projection_suffix(k): a for k, a in rebuilt.items() if _projection_suffix(k)}
    checked = 0
    for key in ours:
        suffix = next((s for s in by_suffix if key.endswith(s)), None)
        if suffix is None:
            assert _raw(ours[key]) == _raw(stock[key]), key  # norms, embedding: unchanged
            continue
        assert _raw(ours[key])[2] == np.ascontiguousarray(by_suffix[suffix]).tobytes(), key
        checked += 1
    assert checked == len(by_suffix)  # every projection, global layers' own shapes included
    assert any(_raw(ours[k]) != _raw(stock[k]) for k in ours if k.endswith("q_proj.weight"))


def test_gemma4_31b_shape_dense_decomposed_at_load(gemma4_31b: Path) -> None:
    """A dense checkpoint of the 31B shape served at G < L is decomposed at load like core's
    rebuild_dense_state; at passthrough it is handed over unchanged."""
    assert plan_serving(gemma4_31b, ServingOptions(path="precompute-outside")).passthrough
    state = dict(
        plan_serving(
            gemma4_31b, ServingOptions(path="precompute-outside", blocks=2, rank=4)
        ).state()
    )
    expected = dict(rebuild_dense_state(gemma4_31b, blocks=2, rank=4))
    assert state.keys() == expected.keys()
    for key, array in expected.items():
        assert state[key].tobytes() == array.tobytes(), key


def test_gemma4_31b_shape_theta_with_wrong_blocks_is_refused_naming_layers(
    gemma4_31b: Path, tmp_path: Path
) -> None:
    decompose_checkpoint(gemma4_31b, tmp_path / "theta", blocks=2, rank=2)
    with pytest.raises(BandMismatchError, match=r"blocks=2.*blocks=1.*layers \["):
        plan_serving(tmp_path / "theta", ServingOptions(path="precompute-outside", blocks=1))


def test_gemma4_31b_shape_in_graph_is_refused_in_one_line(gemma4_31b: Path, tmp_path: Path) -> None:
    """The in-graph paths hold one band layout per family; grouped families are named."""
    decompose_checkpoint(gemma4_31b, tmp_path / "theta", blocks=2, rank=2)
    in_graph = ServingOptions(path="gemm", blocks=2)
    for path in (gemma4_31b, tmp_path / "theta"):
        with pytest.raises(
            NotImplementedError, match=r"q_proj@full_attention.*--path precompute-outside"
        ) as info:
            plan_serving(path, in_graph)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ARCHS)
def test_banded_theta_is_rebuilt_before_the_stock_adapter(
    name: str, max_archs: dict[str, Any], dense: dict[str, Path], banded: dict[str, Path]
) -> None:
    stock = _stock_state(name, max_archs, dense[name])
    ours = _our_state(name, max_archs, banded[name], ServingOptions(path="precompute-outside"))
    rebuilt = dict(plan_serving(banded[name], ServingOptions(path="precompute-outside")).state())
    assert sorted(ours) == sorted(stock)
    projections = [k for k in stock if k.endswith("q_proj.weight")]
    assert projections and any(_raw(ours[k]) != _raw(stock[k]) for k in projections)
    # The projection MAX gets is the rebuilt W_eff, in the source dtype.
    key = f"{STACKS[name]}.0.self_attn.q_proj.weight"
    assert rebuilt[key].dtype.name == "bfloat16"
    max_key = next(k for k in ours if k.endswith("layers.0.self_attn.q_proj.weight"))
    assert _raw(ours[max_key])[2] == np.ascontiguousarray(rebuilt[key]).tobytes()


# -- what is refused --------------------------------------------------------------------------


def _drop(directory: Path, key: str) -> None:
    for file in directory.glob("*.safetensors"):
        tensors = safetensors.numpy.load_file(file)
        if key in tensors:
            del tensors[key]
            safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})
            return
    raise KeyError(key)


@pytest.mark.parametrize("name", ARCHS)
def test_wrong_blocks_is_refused_naming_the_layers(
    name: str, max_archs: dict[str, Any], banded: dict[str, Path]
) -> None:
    with pytest.raises(BandMismatchError) as info:
        _our_state(
            name, max_archs, banded[name], ServingOptions(path="precompute-outside", blocks=1)
        )
    assert "layers [2, 3] have no band-compatible W0" in str(info.value)
    assert "ATTNQUANT_BLOCKS" in str(info.value)


@pytest.mark.parametrize("name", ARCHS)
def test_missing_tensor_is_refused_naming_it(
    name: str, max_archs: dict[str, Any], banded: dict[str, Path], tmp_path: Path
) -> None:
    broken = shutil.copytree(banded[name], tmp_path / "broken")
    missing = f"{STACKS[name]}.2.post_feedforward_layernorm.weight"
    _drop(broken, missing)
    with pytest.raises(WeightKeyError) as info:
        _our_state(name, max_archs, broken, ServingOptions(path="precompute-outside"))
    assert missing in str(info.value) and "zeros" in str(info.value)


@pytest.mark.parametrize("name", ARCHS)
def test_missing_theta_tensor_is_refused_naming_the_layer(
    name: str, max_archs: dict[str, Any], banded: dict[str, Path], tmp_path: Path
) -> None:
    broken = shutil.copytree(banded[name], tmp_path / "broken")
    _drop(broken, f"{STACKS[name]}.3.mlp.up_proj.theta_V")
    with pytest.raises(BandMismatchError) as info:
        _our_state(name, max_archs, broken, ServingOptions(path="precompute-outside"))
    assert "mlp.up_proj layer 3" in str(info.value)


@pytest.mark.parametrize("name", ARCHS)
def test_leftover_theta_keys_are_refused_naming_them(
    name: str, max_archs: dict[str, Any], banded: dict[str, Path], tmp_path: Path
) -> None:
    """Theta keys the manifest does not describe (a family dropped from attnquant.json), or
    theta keys in a checkpoint that lost its attnquant.json, are refused by name."""
    broken = shutil.copytree(banded[name], tmp_path / "broken")
    manifest = json.loads((broken / "attnquant.json").read_text())
    del manifest["families"]["mlp.up_proj"]
    (broken / "attnquant.json").write_text(json.dumps(manifest))
    with pytest.raises(ThetaFormatError) as info:
        _our_state(name, max_archs, broken, ServingOptions(path="precompute-outside"))
    assert f"{STACKS[name]}.1.mlp.up_proj.theta_s" in str(info.value)
    (broken / "attnquant.json").unlink()
    with pytest.raises(WeightKeyError) as info:
        _our_state(name, max_archs, broken, ServingOptions(path="precompute-outside"))
    assert f"{STACKS[name]}.0.self_attn.k_proj.theta_U" in str(info.value)  # listed by name
    assert "no attnquant.json" in str(info.value)


def test_dense_gemma4_missing_a_layer_weight_is_refused(
    max_archs: dict[str, Any], tmp_path: Path
) -> None:
    path = write_tiny_gemma4(tmp_path / "g4")
    _drop(path, "model.language_model.layers.3.self_attn.k_norm.weight")
    with pytest.raises(WeightKeyError, match=r"layers\.3\."):
        _our_state(
            "Gemma4ForConditionalGeneration",
            max_archs,
            path,
            ServingOptions(path="precompute-outside"),
        )


# -- devices ------------------------------------------------------------------------------------


def test_gpu_only_table_is_max_s(max_archs: dict[str, Any]) -> None:
    """Every Gemma architecture we register is in the table, with MAX's own encodings, and
    MAX runs none of those encodings on a CPU."""
    from max.pipelines.modeling.config_enums import supported_encoding_supported_devices

    gemma = {name for name in max_archs if name.startswith("Gemma")} - {"Gemma3ForCausalLM"}
    assert gemma == set(GPU_ONLY_ARCHITECTURES)
    for name, encodings in GPU_ONLY_ARCHITECTURES.items():
        assert set(max_archs[name].supported_encodings) == set(encodings), name
        for encoding in encodings:
            assert "cpu" not in supported_encoding_supported_devices(encoding), encoding
    for name in set(max_archs) - gemma:  # Llama and attnquant's Gemma 3 text do run on a CPU
        assert "float32" in max_archs[name].supported_encodings


@pytest.mark.parametrize("name", [a for a in ARCHS if a != "Gemma3ForCausalLM"])
def test_gemma_on_a_cpu_says_it_needs_a_gpu(name: str, dense: dict[str, Path]) -> None:
    with pytest.raises(DeviceError) as info:
        require_device(dense[name], "cpu")
    message = str(info.value)
    assert name in message and "needs a GPU in MAX 26.7" in message
    assert "bfloat16" in message and "float32" in message
    require_device(dense[name], "gpu")  # asked for a GPU: MAX decides
    with pytest.raises(DeviceError, match="not 'float32'"):
        require_device(dense[name], "gpu", "float32")


def test_load_pipeline_and_serve_command_refuse_gemma_on_a_cpu(dense: dict[str, Path]) -> None:
    from attnquant_max import load_pipeline, serve_command

    path = dense["Gemma3ForConditionalGeneration"]
    with pytest.raises(DeviceError, match="needs a GPU"):
        load_pipeline(path, max_length=64)
    with pytest.raises(DeviceError, match="needs a GPU"):
        serve_command(path, port=8000)
    assert "--devices" in serve_command(path, port=8000, devices="gpu")


def test_llama_and_gemma3_text_are_not_refused(tmp_path: Path) -> None:
    from attnquant_max.testing import write_tiny_llama

    require_device(write_tiny_llama(tmp_path / "llama"), "cpu")
    require_device(write_tiny_gemma3(tmp_path / "gemma3", sliding_window=512), "cpu")
    require_device(tmp_path / "nowhere", "cpu")  # no config: left to the loader


def test_gemma3_window_below_the_cpu_kernel_s_is_refused(dense: dict[str, Path]) -> None:
    path = dense["Gemma3ForCausalLM"]  # sliding window 8
    with pytest.raises(DeviceError) as info:
        require_device(path, "cpu")
    message = str(info.value)
    assert "sliding_window 8" in message and "128" in message and "--forward numpy" in message
    require_device(path, "gpu")  # MAX's GPU attention: no such limit known
