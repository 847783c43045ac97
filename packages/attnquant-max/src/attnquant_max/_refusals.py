"""What a path cannot serve, refused at start-up in one line naming the option to pass."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attnquant_core.serving import ServingOptions

__all__ = [
    "REBUILD_AT_LOAD",
    "check_custom_op_rank",
    "refuse_forms_off_gemm",
    "refuse_grouped_in_graph",
    "refuse_nvfp4_w0",
]

#: The way out every refusal offers: the stock graph, every family rebuilt once at load.
REBUILD_AT_LOAD = (
    "--path precompute-outside (ATTNQUANT_PATH=precompute-outside), which rebuilds every "
    "family once at load"
)


def refuse_grouped_in_graph(path: Path, serving: str, grouped: list[str]) -> None:
    """An in-graph path refuses families grouped by layer shape, naming them, in one line.

    Gemma 4 31B's global layers have their own head size and no ``v_proj``: core groups its
    families by layer shape, which precompute-outside rebuilds like any other; the in-graph
    paths hold one band layout per family.
    """
    if serving == "precompute-outside" or not grouped:
        return
    raise NotImplementedError(
        f"{path}: the {serving} path (in-graph theta) serves families of one shape across "
        f"layers; this model's layers differ in shape ({', '.join(grouped)}). Serve it with "
        f"{REBUILD_AT_LOAD}"
    )


def refuse_forms_off_gemm(
    path: Path, serving: str, forms: Mapping[str, str], blocks: int | None
) -> None:
    """The in-graph precompute path serves banded families with one ``G``; the custom op
    serves every form, its banded families with one ``G`` (one band layout of ``W0`` blocks);
    the GEMM path serves every form. Refused in one line naming what does not fit."""
    banded = [n for n, f in forms.items() if f == "banded"]
    if serving == "custom-op":
        if not banded or blocks is not None:
            return
        raise NotImplementedError(
            f"{path}: the custom-op path serves banded families with one G only; this "
            f"checkpoint's banded families ({', '.join(sorted(banded))}) have different G. "
            f"Serve it with --path gemm (ATTNQUANT_PATH=gemm), or {REBUILD_AT_LOAD}"
        )
    if serving != "precompute":
        return
    other = sorted(f"{n} ({f})" for n, f in forms.items() if f != "banded")
    if not other and blocks is not None:
        return
    what = ", ".join(other) if other else "banded families with different G"
    raise NotImplementedError(
        f"{path}: the {serving} path serves banded families with one G only; this checkpoint "
        f"has {what}. Serve it with --path gemm or --path custom-op (ATTNQUANT_PATH), or "
        f"{REBUILD_AT_LOAD}"
    )


def check_custom_op_rank(path: str, rank: int, model_path: Path) -> None:
    """The custom op serves ``r <= 64`` (attnquant-kernels' limit); say so at start-up."""
    if path == "custom-op":
        from attnquant_kernels import check_rank

        check_rank(rank, what=f"{model_path}: the custom-op path at")


def refuse_nvfp4_w0(
    path: Path, options: ServingOptions, nvfp4: list[str], ckpt: Any, why_not: str
) -> None:
    """A checkpoint whose ``W0`` is NVFP4 is served packed on the GEMM path; every combination
    that would dequantize ``W0`` inside another in-graph path is refused in one line."""
    stored = f"{path}: stores W0 in NVFP4 ({', '.join(nvfp4)})"
    rebuild = f"or serve W_eff rebuilt once at load with {REBUILD_AT_LOAD} and no --quant"
    if options.path == "precompute":
        raise NotImplementedError(
            f"{stored}; in-graph precompute (--path precompute) would form W_eff from a "
            f"dequantized W0 on every forward. Pass --path gemm to serve W0 packed in the graph, "
            f"{rebuild}"
        )
    if options.path == "custom-op":
        raise NotImplementedError(
            f"{stored}; the custom-op path (--path custom-op: generated_linear, generated_mlp) "
            "reads a float W0. Pass --path gemm (or auto) to serve each projection from the "
            "packed W0 (--nvfp4-kernel fused: one generated_linear_nvfp4 dispatch; dequantize: "
            f"W0 dequantized in the graph), {rebuild}"
        )
    grouped = [n for n, f in ckpt.families.items() if "layers" in f]
    if grouped:
        raise NotImplementedError(
            f"{stored}; the in-graph NVFP4 path serves families of one shape across layers, and "
            f"this model's layers differ in shape ({', '.join(grouped)}). Serve it with "
            f"{REBUILD_AT_LOAD} and no --quant"
        )
    if why_not:
        raise NotImplementedError(
            f"{stored}; the in-graph NVFP4 path cannot serve it: {why_not}. Serve it with "
            f"{REBUILD_AT_LOAD} and no --quant"
        )
