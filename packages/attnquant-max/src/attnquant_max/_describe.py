"""The start-up line of a serving plan: which path, which ``G`` and ``r``, and why."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from ._config import PATH_DESCRIPTIONS

if TYPE_CHECKING:
    from ._plan import ServingPlan

__all__ = ["NVFP4_EMULATED", "NVFP4_HEAD", "describe_plan"]

#: What ``--quant nvfp4`` serves, said once in the start-up log.
NVFP4_EMULATED = (
    "--quant nvfp4 (ATTNQUANT_QUANT=nvfp4): each W_eff quantized to NVFP4 at load (E2M1 codes, "
    "E4M3 scale per 16 inputs, FP32 per-tensor scale) and held packed; per --nvfp4-kernel either "
    "dequantized inside the graph then a float32 matmul, or one fused generated_linear_nvfp4 "
    "dispatch decoding the packed bytes in registers (auto: the faster, timed at start-up); no "
    "native FP4 matmul is used"
)

#: What ``--quant-head`` adds to the start-up line.
NVFP4_HEAD = (
    "the output head in NVFP4 too (--quant-head, ATTNQUANT_QUANT_HEAD=1; a tied head quantized "
    "from the embedding table, which stays float unless --quant-embedding)"
)

#: What ``--quant-embedding`` adds to the start-up line.
NVFP4_EMBEDDING = (
    "the embedding table in NVFP4 too (--quant-embedding, ATTNQUANT_QUANT_EMBEDDING=1; its rows "
    "gathered packed and decoded in the graph, a tied model's from the head's bytes)"
)

#: How each ``--nvfp4-kernel`` runs a projection of an NVFP4-``W0`` checkpoint.
_NVFP4_THETA_KERNEL = {
    "fused": "each projection one generated_linear_nvfp4(x, W0_packed, W0_scale, W0_scale_2, s, "
    "U, V) dispatch, W0 decoded in registers (--nvfp4-kernel fused)",
    "dequantize": "W0 dequantized in the graph, then s*(x W0^T) + (x V) U^T "
    "(--nvfp4-kernel dequantize)",
    "auto": "each projection one fused generated_linear_nvfp4 dispatch or W0 dequantized in the "
    "graph then s*(x W0^T) + (x V) U^T, the faster as timed at start-up (--nvfp4-kernel auto)",
}


def _blocks(plan: ServingPlan) -> str:
    g = "layers (passthrough)" if plan.passthrough else str(plan.blocks)
    if plan.blocks is None or any(form != "banded" for form in plan.forms.values()):
        counts = Counter(plan.forms.values())
        g = f"{plan.blocks} (forms: " + ", ".join(f"{n} {f}" for f, n in counts.items()) + ")"
    return g


def _fusion(plan: ServingPlan) -> str:
    """What runs in one dispatch on the in-graph path of ``plan``."""
    options = plan.options
    mixed = any(form != "banded" for form in plan.forms.values())
    if plan.path == "custom-op" and mixed:
        return (
            "one generated_linear per banded projection, one generated_lowrank per low-rank or "
            "shared-basis one; an MLP in one generated_mlp where all three are banded"
            + ("" if options.fused_mlp else " (not: --no-fused-mlp)")
        )
    if plan.path == "custom-op":
        return (
            "one generated_linear per projection; the MLP in one generated_mlp"
            if options.fused_mlp
            else "one generated_linear per projection (--no-fused-mlp)"
        )
    how = ("fused where the forms allow" if mixed else "fused") if options.qkv_fuse else None
    return f"q/k/v and gate/up {how or 'separate (--no-qkv-fuse)'}"


def describe_plan(plan: ServingPlan) -> str:
    """One line for the start-up log: what is served, on which path, and why."""
    where = f"{plan.source} checkpoint {plan.model_path}"
    why = f"; chosen by {plan.reason}" if plan.reason else ""
    head = f"; {NVFP4_HEAD}" if plan.head_nvfp4 else ""
    head += f"; {NVFP4_EMBEDDING}" if plan.embedding_nvfp4 else ""
    if not plan.rebuilds:
        return f"attnquant: serving {where} unchanged (passthrough, no rebuild){why}"
    g = _blocks(plan)
    shape = f"G={g}, r={plan.rank}, L={plan.num_layers}"
    if plan.nvfp4_w0:
        return _describe_nvfp4(plan, where) + f"; {shape}{why}{head}"
    how = "theta keys" if plan.source == "theta" else "decomposition at load"
    if plan.in_graph:
        return (
            f"attnquant: serving {where} on the {PATH_DESCRIPTIONS[plan.path]}; {_fusion(plan)}; "
            f"theta from {how}, {shape}{why}{head}"
        )
    line = (
        f"attnquant: serving {where} on the precompute-outside path: W_eff = s*W0 + U V^T "
        f"rebuilt once at load from {how}, {shape}"
    )
    if plan.quantized:
        line += "; " + NVFP4_EMULATED
    return line + why + head


def _describe_nvfp4(plan: ServingPlan, where: str) -> str:
    """:func:`describe_plan` of a checkpoint with NVFP4-``W0`` families: what each form runs as."""
    nvfp4 = plan.nvfp4_families
    line = (
        f"attnquant: serving {where} in the graph holding its stored bytes: "
        f"{len(nvfp4)} famil{'y' if len(nvfp4) == 1 else 'ies'} ({', '.join(nvfp4)}) banded "
        f"with an NVFP4 W0 held packed as stored (E2M1 codes, E4M3 scale per 16 inputs, "
        f"FP32 per-tensor scale; one copy per band, 4.5 bits per weight; not dequantized at "
        f"load) with s, U, V per layer: {_NVFP4_THETA_KERNEL[plan.options.nvfp4_kernel]}"
    )
    other = {n: f for n, f in plan.forms.items() if n not in nvfp4}
    if other:
        counts = Counter("banded (float W0)" if f == "banded" else f for f in other.values())
        fuse = (
            "q/k/v and gate/up fused where the forms allow, per member in a group with an "
            "NVFP4 member"
            if plan.options.qkv_fuse
            else "separate (--no-qkv-fuse)"
        )
        line += (
            "; "
            + ", ".join(f"{n} {f}" for f, n in counts.items())
            + f" on the GEMM path as stored ({fuse})"
        )
    return line
