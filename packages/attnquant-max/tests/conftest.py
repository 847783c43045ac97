"""Fixtures: one tiny random Llama checkpoint (fixed seed, fixed shape) and its theta variants.

The model, its shape and serving size live in :mod:`attnquant_max.testing`, shared with the
integration tests, so each execution path compiles one model graph for the whole CI run
(~1-2 min cold on 2 cores, 1-2 s from ~/.cache/modular after).

The session runs on pytest-xdist workers (the noxfile passes ``-n``): a MAX compile keeps about
one core busy, so two graphs compile side by side in the time of one. Each test module, and
each in-graph path, is one ``xdist_group`` (one worker, fixtures built once), the groups that
compile a graph are handed out first, longest first, and :func:`load_tiny` holds a lock per
graph, so a worker that needs a graph the other one is compiling waits for it and then reads it
from MAX's cache instead of compiling it a second time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.numpy

from attnquant_core import decompose_checkpoint
from attnquant_max.testing import (
    HIDDEN,
    LAYERS,
    MAX_BATCH_SIZE,
    MAX_LENGTH,
    PROJECTIONS,
    graph_lock,
    tiny_llama_tensors,
    write_tiny_bundle,
    write_tiny_llama,
)
from attnquant_max.testing import load_tiny as _load_tiny

__all__ = [
    "HIDDEN",
    "LAYERS",
    "MAX_BATCH_SIZE",
    "MAX_LENGTH",
    "PROJECTIONS",
    "load_tiny",
    "tiny_llama_tensors",
    "write_tiny_llama",
]


# The xdist groups that compile a whole graph, longest compile first (cold, 2 cores): the stock
# graph comes with "gemm" (its first test loads both), and "custom", "nvfp4" and "nvfp4-fused"
# read the stock graph from the cache by the time they need it. The two NVFP4 forms are two
# groups (each about 4-7 min cold) so that the two workers compile them side by side;
# "nvfp4-theta" (a checkpoint mixing NVFP4-W0 banded families with float forms, served in the
# graph on the fused op) is one more; its layers' dequantize form rides in the "layers" graph.
# "custom-budget" is a budget checkpoint's forms on the custom op (about 3 min cold);
# "custom-dense" the dense tiny Llama on the custom op, decomposed at load at passthrough.
# "gemma3" is a tiny Gemma 3 on attnquant's own architecture (echo, a 700-token prompt);
# "qwen2" the tiny Llama's shape on MAX's own Qwen2 graph (test_families_graph.py).
# Everything else runs after them.
GRAPH_GROUPS = (
    "gemm",
    "layers",
    "gemma3",
    "qwen2",
    "precompute",
    "nvfp4",
    "nvfp4-fused",
    "nvfp4-theta",
    "custom",
    "custom-budget",
    "custom-dense",
    "stock",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the groups that compile first, longest first (the order xdist hands them out)."""

    def rank(item: pytest.Item) -> int:
        mark = item.get_closest_marker("xdist_group")
        name = mark.args[0] if mark is not None and mark.args else None
        return GRAPH_GROUPS.index(name) if name in GRAPH_GROUPS else len(GRAPH_GROUPS)

    items.sort(key=rank)  # stable: each module's (and each path's) tests stay together


def load_tiny(path: Path, config: Any = None) -> Any:
    """:func:`attnquant_max.testing.load_tiny`, one worker at a time per graph: the stock graph
    (``config=None``, any checkpoint served at precompute-outside) or an execution path's."""
    from attnquant_max import ServingOptions

    with graph_lock(repr(ServingOptions(path="precompute-outside") if config is None else config)):
        return _load_tiny(path, config)


def rewrite_tensors(directory: Path, drop: str) -> None:
    """Rewrite every safetensors file of ``directory`` without the key ``drop``."""
    for file in directory.glob("*.safetensors"):
        tensors = safetensors.numpy.load_file(file)
        if drop in tensors:
            del tensors[drop]
            safetensors.numpy.save_file(tensors, file)
            return
    raise KeyError(drop)


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "dense")


@pytest.fixture(scope="session")
def tiny_theta(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense checkpoint decomposed at passthrough (G = L), rank 4."""
    out = tmp_path_factory.mktemp("ckpt") / "theta"
    decompose_checkpoint(tiny_dense, out, blocks="layers", rank=4)
    return out


@pytest.fixture(scope="session")
def tiny_theta_g1(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense checkpoint decomposed with one shared block per family, rank 8."""
    out = tmp_path_factory.mktemp("ckpt") / "theta_g1"
    decompose_checkpoint(tiny_dense, out, blocks=1, rank=8)
    return out


@pytest.fixture(scope="session")
def tiny_budget(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama fitted to half its size: forms and ranks chosen per family and layer."""
    out = tmp_path_factory.mktemp("ckpt") / "budget"
    decompose_checkpoint(tiny_dense, out, budget=0.5)
    return out


@pytest.fixture(scope="session")
def tiny_bundle(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The in-graph paths' bundle: one W0 per layer, a scale and a rank-16 correction at work."""
    return write_tiny_bundle(tiny_dense, tmp_path_factory.mktemp("ckpt") / "bundle")


@pytest.fixture(scope="session")
def dense_model(tiny_dense: Path) -> Iterator[Any]:
    """The dense tiny Llama, stock graph."""
    with load_tiny(tiny_dense) as model:
        yield model


@pytest.fixture(scope="session")
def theta_model(tiny_theta: Path) -> Iterator[Any]:
    """The passthrough theta checkpoint on the precompute-outside path (stock graph)."""
    with load_tiny(tiny_theta) as model:
        yield model


@pytest.fixture(scope="session")
def theta_missing_v(tiny_theta: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Passthrough theta checkpoint with ``layers.1.mlp.up_proj.theta_V`` removed."""
    out = tmp_path_factory.mktemp("ckpt") / "theta_missing_v"
    shutil.copytree(tiny_theta, out)
    rewrite_tensors(out, "model.layers.1.mlp.up_proj.theta_V")
    return out


@pytest.fixture(scope="session")
def theta_other_blocks(tiny_theta: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Passthrough theta checkpoint whose attnquant.json claims ``blocks = 1``."""
    out = tmp_path_factory.mktemp("ckpt") / "theta_other_blocks"
    shutil.copytree(tiny_theta, out)
    manifest = json.loads((out / "attnquant.json").read_text())
    manifest["blocks"] = 1
    (out / "attnquant.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="session")
def dense_missing_weight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense checkpoint without ``model.layers.1.post_attention_layernorm.weight``."""
    tensors = tiny_llama_tensors()
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "dense_missing", tensors)


@pytest.fixture(scope="session")
def theta_without_manifest(tiny_theta: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A theta checkpoint whose attnquant.json was lost: the stock loader would zero-fill."""
    out = tmp_path_factory.mktemp("ckpt") / "theta_no_manifest"
    shutil.copytree(tiny_theta, out)
    (out / "attnquant.json").unlink()
    return out
