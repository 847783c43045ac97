"""The serving plan: what a load of a checkpoint serves, decided once from the options.

:func:`plan_serving` turns :class:`attnquant_max.ServingOptions` and a checkpoint into one
:class:`ServingPlan`; the weight adapter hands the state it implies to MAX together with the
plan (:class:`attnquant_max._adapter.PlannedState`), and the graph builder reads the same plan,
so nothing downstream re-derives the choice. ``--path auto`` (the default) follows the
checkpoint: a dense or passthrough one on the stock graph, a compressed theta checkpoint of a
Llama model in the graph holding its own bytes (docs/serving-paths.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from attnquant_core import ThetaCheckpoint, is_theta_checkpoint, open_checkpoint
from attnquant_core.serving import ServingOptions, dense_state, quantized_state, theta_state

from ._config import (
    CUSTOM_OP_MAX_RANK,
    ServingPath,
    _accelerator_api,
    _architecture,
    require_implemented,
    serving_path,
)
from ._describe import describe_plan
from ._refusals import (
    check_custom_op_rank,
    refuse_forms_off_gemm,
    refuse_grouped_in_graph,
    refuse_nvfp4_w0,
)

__all__ = ["IN_GRAPH_ARCHITECTURES", "ServingPlan", "log_serving_path", "plan_serving"]

logger = logging.getLogger(__name__)

#: Architectures whose attnquant pipeline model builds the in-graph theta model.
IN_GRAPH_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM")


@dataclass(frozen=True, kw_only=True)
class ServingPlan:
    """What a load of ``model_path`` serves, decided once from the options and the checkpoint.

    Attributes
    ----------
    model_path : Path
        The checkpoint directory.
    source : "theta" or "dense"
        A theta checkpoint (``attnquant.json`` present) or a dense one.
    blocks : int, "layers" or None
        ``G`` of the weights served; ``"layers"`` for a dense checkpoint at passthrough;
        ``None`` when a theta checkpoint's families do not share one banded ``G``.
    rank : int
        ``r`` of the correction (``0`` for a dense checkpoint at passthrough).
    num_layers : int
        Decoder layers ``L``.
    path : str
        The execution path: ``precompute-outside``, ``gemm``, ``custom-op`` or ``precompute``.
    options : ServingOptions
        What the load was asked for.
    accelerator_api : str or None
        What ``max.driver.accelerator_api()`` said, when it decided the path.
    forms : dict of str to str
        A theta checkpoint's form per family; empty for a dense checkpoint.
    reason : str
        Why this path, in words, for the start-up line.
    nvfp4_families : tuple of str
        The families banded with a ``W0`` stored in NVFP4, served in the graph as stored (the
        packed ``W0`` once per band; every other family as the GEMM path serves its form).
    """

    model_path: Path
    source: Literal["theta", "dense"]
    blocks: int | Literal["layers"] | None
    rank: int
    num_layers: int
    path: ServingPath = "precompute-outside"
    options: ServingOptions = field(default_factory=ServingOptions, repr=False)
    accelerator_api: str | None = None
    forms: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    nvfp4_families: tuple[str, ...] = ()

    @property
    def nvfp4_w0(self) -> bool:
        """Whether some family's NVFP4 ``W0`` is served packed in the graph."""
        return bool(self.nvfp4_families)

    @property
    def in_graph(self) -> bool:
        """Whether the graph holds the theta tensors (GEMM, in-graph precompute, custom op)."""
        return self.path in ("gemm", "precompute", "custom-op")

    @property
    def quantized(self) -> bool:
        """Whether each ``W_eff`` is quantized at load (``--quant nvfp4``); never for a
        checkpoint whose ``W0`` is already NVFP4 (served as stored, not quantized twice)."""
        return self.options.quant is not None and not self.nvfp4_w0

    @property
    def head_nvfp4(self) -> bool:
        """Whether the output head is quantized at load (``--quant-head`` beside NVFP4
        projections or on an in-graph path)."""
        return self.options.quant_head and (self.quantized or self.nvfp4_w0 or self.in_graph)

    @property
    def embedding_nvfp4(self) -> bool:
        """Whether the embedding table is quantized at load too (``--quant-embedding`` beside
        an NVFP4 head); a tied model's lookup then reads the head's bytes."""
        return self.options.quant_embedding and self.head_nvfp4

    @property
    def rebuilds(self) -> bool:
        """Whether the state MAX loads differs from the checkpoint's (``False`` only for a
        dense checkpoint at passthrough on the stock graph)."""
        return self.in_graph or self.quantized or self.source == "theta" or self.blocks != "layers"

    @property
    def passthrough(self) -> bool:
        """Whether ``G = L``: each layer keeps its own ``W0`` and the rebuild is exact."""
        banded = all(form == "banded" for form in self.forms.values())
        return banded and (self.blocks == "layers" or self.blocks == self.num_layers)

    def describe(self) -> str:
        """One line for the start-up log: what is served, on which path, and why."""
        return describe_plan(self)

    def theta_state(self) -> Iterator[tuple[str, np.ndarray]]:
        """In-graph paths: every tensor the theta model reads (:func:`attnquant_core.serving.theta_state`)."""
        return theta_state(self)

    def quantized_state(self) -> Iterator[tuple[str, np.ndarray]]:
        """:meth:`state` with every projection quantized to NVFP4 (:func:`attnquant_core.serving.quantized_state`)."""
        return quantized_state(self)

    def state(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every dense key of the model with its array (original names, source dtype)."""
        return dense_state(self)


def plan_serving(model_path: str | Path, options: ServingOptions | None = None) -> ServingPlan:
    """Decide what serving ``model_path`` means under ``options`` (``ServingOptions()``: auto).

    A theta checkpoint is opened and validated at once (its keys against its bands, and
    against ``options.blocks`` when set), so a mismatch fails here, before MAX builds anything.

    Raises
    ------
    NotImplementedError
        ``options`` ask for a path this release does not serve for this checkpoint; one line
        naming the option to change.
    attnquant_core.CheckpointError
        The checkpoint cannot be read (``BandMismatchError`` for keys that miss their bands).
    """
    options = ServingOptions() if options is None else options
    plan = _plan_serving(Path(model_path), options)
    if options.quant_embedding and not plan.head_nvfp4:
        raise NotImplementedError(
            f"{plan.model_path}: --quant-embedding (ATTNQUANT_QUANT_EMBEDDING=1) puts the "
            "embedding table in NVFP4 beside an NVFP4 head: pass --quant-head too (with "
            "--quant nvfp4 or on an in-graph path), or drop --quant-embedding"
        )
    return plan


def _plan_serving(path: Path, options: ServingOptions) -> ServingPlan:
    """:func:`plan_serving` before the refusals that read the finished plan."""
    theta = is_theta_checkpoint(path)
    ckpt = ThetaCheckpoint.open(path, blocks=options.blocks) if theta else None
    in_graph_ok, why_not = _in_graph_possible(path, ckpt)
    nvfp4 = [] if ckpt is None else _nvfp4_families(ckpt)
    auto = options.path == "auto"
    if nvfp4 and (options.quant is not None or options.in_graph_asked or (auto and in_graph_ok)):
        return _plan_nvfp4_w0(path, options, ckpt, nvfp4, why_not)
    require_implemented(options)
    compressed = ckpt is not None and (bool(nvfp4) or not _passthrough(ckpt))
    reason = _auto_reason(options, ckpt, compressed, in_graph_ok, why_not) if auto else ""
    in_graph = options.in_graph_asked or (
        auto and compressed and in_graph_ok and options.quant is None
    )
    api = None
    if in_graph and options.path in ("in-graph", "auto"):
        api = _accelerator_api()
    # ``--rank`` is the rank of a dense checkpoint decomposed at load; a theta checkpoint's own
    # ranks are weighed by _auto_custom_op below, which says why it falls back to GEMM.
    served = options if ckpt is None else replace(options, rank=0)
    concrete = serving_path(served, api, compressed=in_graph) if in_graph else "precompute-outside"
    if not reason:
        reason = _explicit_reason(options, api)
    if options.quant_head and not in_graph and options.quant is None:
        raise NotImplementedError(
            f"{path}: --quant-head (ATTNQUANT_QUANT_HEAD=1) puts the output head in NVFP4 beside "
            "NVFP4 projections (--quant nvfp4) or on an in-graph path, not in the stock graph "
            f"of precompute-outside, which {reason} chose: pass one of those, or drop --quant-head"
        )
    common: dict[str, Any] = {
        "model_path": path,
        "path": concrete,
        "options": options,
        "accelerator_api": api,
        "reason": reason,
    }
    if ckpt is not None:
        forms = ckpt.forms
        banded = _banded_rank(ckpt)
        if concrete == "custom-op" and options.path != "custom-op":
            common.update(_auto_custom_op(ckpt, api, banded, reason))
        refuse_forms_off_gemm(path, common["path"], forms, ckpt.blocks)
        refuse_grouped_in_graph(
            path, common["path"], [n for n, f in ckpt.families.items() if "layers" in f]
        )
        check_custom_op_rank(common["path"], banded, path)
        return ServingPlan(
            source="theta",
            blocks=ckpt.blocks,
            rank=ckpt.rank,
            num_layers=ckpt.num_layers,
            forms=forms,
            **common,
        )
    blocks = "layers" if options.blocks is None else options.blocks
    rank = 0 if blocks == "layers" else options.rank
    dense = open_checkpoint(path)
    refuse_grouped_in_graph(
        path, concrete, [n for n, f in dense.families.items() if f.group is not None]
    )
    check_custom_op_rank(concrete, rank, path)
    return ServingPlan(
        source="dense", blocks=blocks, rank=rank, num_layers=dense.num_layers, **common
    )


def _banded_rank(ckpt: ThetaCheckpoint) -> int:
    """The largest correction rank of the banded families (``0`` when there is none)."""
    ranks = [max(ckpt.ranks(n), default=0) for n, f in ckpt.forms.items() if f == "banded"]
    return max(ranks, default=0)


def _passthrough(ckpt: ThetaCheckpoint) -> bool:
    """Whether every family is banded at ``G = L`` (nothing smaller than the dense weights)."""
    return all(f == "banded" for f in ckpt.forms.values()) and ckpt.blocks == ckpt.num_layers


def _in_graph_possible(path: Path, ckpt: ThetaCheckpoint | None) -> tuple[bool, str]:
    """Whether an in-graph path can serve this checkpoint, and if not, why (for ``auto``)."""
    arch = _architecture(path)
    if arch not in IN_GRAPH_ARCHITECTURES:
        return (
            False,
            f"{arch or 'an unknown architecture'} is served in the graph for "
            + ", ".join(IN_GRAPH_ARCHITECTURES)
            + " only",
        )
    if ckpt is not None:
        grouped = [n for n, f in ckpt.families.items() if "layers" in f]
        if grouped:
            return False, f"families grouped by layer shape ({', '.join(grouped)})"
    return True, ""


def _auto_reason(
    options: ServingOptions,
    ckpt: ThetaCheckpoint | None,
    compressed: bool,
    in_graph_ok: bool,
    why_not: str,
) -> str:
    """Why ``--path auto`` chose what it chose, in words."""
    if ckpt is None:
        return "--path auto: a dense checkpoint is served on the stock graph"
    if not compressed:
        return (
            "--path auto: a theta checkpoint at passthrough (G = L, nothing smaller than the "
            "dense weights) is served on the stock graph"
        )
    if options.quant is not None:
        return "--path auto and --quant nvfp4, which quantizes each W_eff rebuilt at load"
    if not in_graph_ok:
        return f"--path auto: a compressed theta checkpoint, rebuilt at load because {why_not}"
    return (
        "--path auto: a compressed theta checkpoint is served in the graph holding its own "
        "bytes, on the formulation measured faster on this device"
    )


def _explicit_reason(options: ServingOptions, api: str | None) -> str:
    if options.path == "in-graph" or (options.path == "auto" and api is not None):
        return f"--path {options.path} and accelerator API {api!r}"
    return f"--path {options.path}"


def _auto_custom_op(
    ckpt: ThetaCheckpoint, api: str | None, banded_rank: int, reason: str
) -> dict[str, str]:
    """The automatic choice picked the custom op (CPU, Apple Metal): keep it where it serves
    this checkpoint and was measured faster, else the GEMM path; the reason for the log line.

    The custom op holds one band layout of ``W0`` blocks (banded families of one ``G``) and
    corrections up to ``r = 64``. For the forms without ``W0`` (``generated_lowrank``) it was
    measured on the CPU only: a 300M-parameter model fitted to ``--budget 0.5`` decodes 1.337x
    [1.200, 1.521] as fast on the custom op as on the GEMM path, prefills a 512-token prompt at
    0.905x [0.832, 0.970] (``benchmarks/bench_compressed.py --shape 300m --variants "budget 0.5
    custom-op" --against "budget 0.5" --pairs 8``, 2026-12-01, 2 cores): decode is where serving
    spends its steps.
    """
    banded = any(form == "banded" for form in ckpt.forms.values())
    factored = any(form != "banded" for form in ckpt.forms.values())
    if banded and ckpt.blocks is None:
        why = "banded families of different G, which the custom op does not hold"
    elif banded_rank > CUSTOM_OP_MAX_RANK:
        why = f"a banded correction of rank {banded_rank} > {CUSTOM_OP_MAX_RANK}"
    elif factored and (api or "cpu") != "cpu":
        why = "forms without W0, for which the custom op was measured on the CPU only"
    elif factored:
        return {
            "reason": f"{reason}; forms without W0: the custom op (generated_lowrank) decodes "
            "them faster than the GEMM path on the CPU (1.34x at budget 0.5, 300M)"
        }
    else:
        return {}
    return {"path": "gemm", "reason": f"{reason}; GEMM, for {why}"}


def _nvfp4_families(ckpt: ThetaCheckpoint) -> list[str]:
    """The families of ``ckpt`` whose ``W0`` is NVFP4 (its manifest's ``quant``)."""
    return sorted(n for n, f in ckpt.families.items() if f.get("quant") == "nvfp4")


def _plan_nvfp4_w0(
    path: Path, options: ServingOptions, ckpt: Any, nvfp4: list[str], why_not: str
) -> ServingPlan:
    """The plan of a checkpoint whose ``W0`` is NVFP4, served in the graph as stored: the packed
    ``W0`` once per band and ``s``, ``U``, ``V`` per layer, every other family as the GEMM path
    serves its form. ``--quant nvfp4`` asks for a 4-bit model, which the checkpoint already is,
    so it is served as stored (quantizing ``W_eff`` again would quantize the correction fitted
    to the quantization error away). Combinations that would dequantize ``W0`` inside an
    in-graph path are refused in one line naming what to pass (:func:`refuse_nvfp4_w0`)."""
    refuse_nvfp4_w0(path, options, nvfp4, ckpt, why_not)
    if options.quant is not None:
        reason = (
            "--quant nvfp4 on a checkpoint whose W0 is already NVFP4: served as stored, not "
            "quantized twice (its float families as stored too)"
        )
    elif options.path == "auto":
        reason = "--path auto: a theta checkpoint whose W0 is NVFP4 is served packed in the graph"
    else:
        reason = f"--path {options.path} and a checkpoint whose W0 is NVFP4 (the custom op reads a float W0)"
    return ServingPlan(
        model_path=path,
        source="theta",
        blocks=ckpt.blocks,
        rank=ckpt.rank,
        num_layers=ckpt.num_layers,
        path="gemm",
        options=options,
        forms=ckpt.forms,
        reason=reason,
        nvfp4_families=tuple(nvfp4),
    )


_logged: set[str] = set()


def log_serving_path(plan: ServingPlan, *, level: int = logging.INFO) -> str:
    """Log, once per distinct plan, which path and which ``G``, ``r`` were chosen, and why.

    Returns the line (logged or not), so a CLI can print it too.
    """
    line = plan.describe()
    if line not in _logged:
        _logged.add(line)
        logger.log(level, line)
    return line
