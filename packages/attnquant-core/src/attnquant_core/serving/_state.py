"""The tensors a plan hands to MAX: rebuilt dense, quantized at load, or the theta tensors.

Each function reads the checkpoint of a serving plan (:class:`StatePlan`: the attributes of
``attnquant_max.ServingPlan`` they read) lazily (one family, band or layer at a time where the
form allows) and yields ``(name, array)`` under the original Hugging Face names, in the source
dtype. numpy only: the plan is made and the arrays are handed to MAX by attnquant-max.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from .._errors import CheckpointError
from ..fit import decompose_family, rebuild_dense_state
from ..forms import quantize_nvfp4
from ..io import (
    ThetaCheckpoint,
    dtype_from_name,
    nvfp4_key,
    open_checkpoint,
    parse_projection_key,
)
from ._layout import ingraph_tensors
from ._options import ServingOptions
from ._tensors import nvfp4_tensors

__all__ = [
    "HEAD_KEY",
    "StatePlan",
    "dense_state",
    "quantized_state",
    "theta_state",
    "with_nvfp4_head",
]


class StatePlan(Protocol):
    """What the state functions read of a serving plan (``attnquant_max.ServingPlan`` is one)."""

    @property
    def model_path(self) -> Path:
        """The checkpoint directory."""
        ...

    @property
    def source(self) -> Literal["theta", "dense"]:
        """A theta checkpoint (``attnquant.json`` present) or a dense one."""
        ...

    @property
    def blocks(self) -> int | Literal["layers"] | None:
        """``G`` of the weights served (``"layers"``: a dense checkpoint at passthrough)."""
        ...

    @property
    def rank(self) -> int:
        """``r`` of the correction a dense checkpoint is decomposed with."""
        ...

    @property
    def path(self) -> str:
        """The execution path (``gemm`` builds band weights)."""
        ...

    @property
    def options(self) -> ServingOptions:
        """What the load was asked for (``blocks``, ``qkv_fuse`` are read)."""
        ...

    @property
    def nvfp4_families(self) -> tuple[str, ...]:
        """The families whose ``W0`` is stored in NVFP4, handed on as stored."""
        ...

    @property
    def head_nvfp4(self) -> bool:
        """Whether the output head is quantized to NVFP4 at load."""
        ...

    @property
    def embedding_nvfp4(self) -> bool:
        """Whether the embedding table is quantized to NVFP4 at load too (beside the head)."""
        ...


#: The output head of a Hugging Face Llama checkpoint (``--quant-head`` quantizes it).
HEAD_KEY = "lm_head.weight"
_EMBEDDING_KEY = "embed_tokens.weight"


def _nvfp4_parts(key: str, q: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The three tensors of an NVFP4 ``<prefix>.weight``, as attnquant-max's NVFP4 layers read them."""
    prefix = key[: -len(".weight")]
    yield key, q.weight
    yield f"{prefix}.weight_scale", q.weight_scale.view(np.uint8)
    yield f"{prefix}.weight_scale_2", np.asarray(q.weight_scale_2, np.float32).reshape(1)


def with_nvfp4_head(
    items: Iterable[tuple[str, np.ndarray]],
    *,
    model_path: str | Path = "",
    embedding: bool = False,
) -> Iterator[tuple[str, np.ndarray]]:
    """``items`` with the output head ``lm_head.weight`` quantized to NVFP4 (three tensors).

    A tied model has no ``lm_head.weight``: its head is quantized from the embedding table,
    which is passed on unchanged (the embedding gathers float rows; the head reads 4.5 bits per
    weight). With ``embedding`` the table is quantized too: an untied model's
    ``embed_tokens.weight`` becomes three tensors under its own name; a tied model's is not
    handed on at all, its lookup reading the head's (one 4-bit table for both, as llama.cpp
    holds a tied table once). Everything else passes unchanged.

    Raises
    ------
    CheckpointError
        Neither a head nor an embedding table to quantize it from.
    NVFP4Error
        The head or the table holds NaN/Inf, or its input size is not a multiple of 16.
    """
    table: tuple[str, np.ndarray] | None = None
    head = False
    for key, array in items:
        if key == HEAD_KEY:
            head = True
            yield from _nvfp4_parts(key, quantize_nvfp4(array, name=key))
            continue
        if key.endswith(_EMBEDDING_KEY) and table is None:
            table = (key, array)
            if embedding:  # quantized below, once it is known whether the head is tied
                continue
        yield key, array
    if table is None and not head:
        raise CheckpointError(
            f"{model_path}: --quant-head (ATTNQUANT_QUANT_HEAD) found neither {HEAD_KEY} nor an "
            f"{_EMBEDDING_KEY} (a tied head) to quantize"
        )
    if table is None:
        if embedding:
            raise CheckpointError(
                f"{model_path}: --quant-embedding (ATTNQUANT_QUANT_EMBEDDING) found no "
                f"{_EMBEDDING_KEY} to quantize"
            )
        return
    if head and embedding:
        yield from _nvfp4_parts(table[0], quantize_nvfp4(table[1], name=table[0]))
    elif not head:
        yield from _nvfp4_parts(HEAD_KEY, quantize_nvfp4(table[1], name=table[0]))


def theta_state(plan: StatePlan) -> Iterator[tuple[str, np.ndarray]]:
    """In-graph paths: every tensor the theta model reads (original names, source dtype);
    with :attr:`head_nvfp4`, the output head quantized (:func:`with_nvfp4_head`).

    The checkpoint's other tensors (embeddings, norms, head), then the
    theta tensors of :func:`attnquant_core.serving._layout.ingraph_tensors`: ``W0V``
    band weights and every other form's factors (or, where they are not smaller,
    the layer's dense weight rebuilt once) on the GEMM path, ``W0`` and ``theta_V`` on
    the in-graph precompute path. A dense checkpoint is decomposed here, with
    ``G``, ``r`` of the plan (passthrough: ``W0 = W``, ``s = 1``, no correction).
    Every float family is held in memory at once (q/k/v share band weights); the families
    of :attr:`nvfp4_families` are read one band and one layer at a time and handed on as
    stored (:func:`attnquant_core.serving._tensors.nvfp4_tensors`): nothing is dequantized.

    Raises
    ------
    attnquant_core.CheckpointError
        An NVFP4 block scale byte is NaN (0x7F/0xFF) or a per-tensor scale is not finite
        and positive; the message names the key.
    """
    return _with_head(plan, _theta_tensors(plan))


def _theta_tensors(plan: StatePlan) -> Iterator[tuple[str, np.ndarray]]:
    """:meth:`theta_state` before the head is quantized."""
    families: dict[str, Any] = {}
    dtypes: dict[str, np.dtype] = {}
    if plan.source == "theta":
        ckpt = ThetaCheckpoint.open(plan.model_path, blocks=plan.options.blocks)
        for key in ckpt.copied_keys():
            yield key, ckpt.tensors.get(key)
        stack = ckpt.stack
        for name, fam in ckpt.families.items():
            dtype = dtype_from_name(fam.get("source_dtype", fam["dtype"]))
            if name in plan.nvfp4_families:
                yield from nvfp4_tensors(
                    name,
                    projection=ckpt.projection_of(name),
                    stack=stack,
                    bands=_checked_nvfp4(plan, ckpt, name),
                    layers=((i, ckpt.layer(name, i)) for i in ckpt.layers_of(name)),
                    cast=lambda a, dtype=dtype: np.ascontiguousarray(a.astype(dtype, copy=False)),
                )
                continue
            families[name] = ckpt.family_theta(name)
            dtypes[name] = dtype
    else:
        dense = open_checkpoint(plan.model_path)
        projection_keys = dense.projection_keys()
        for key in dense.keys():
            if key not in projection_keys:
                yield key, dense.get(key)
        stacks = {info.stack for info in dense.families.values()}
        if len(stacks) != 1:
            raise CheckpointError(
                f"{plan.model_path}: projection families under several stacks {sorted(stacks)}"
            )
        stack = stacks.pop()
        for name, info in dense.families.items():
            weights = [dense.get(k, check_finite=True) for k in info.keys]
            families[name], _ = decompose_family(
                weights, blocks=plan.blocks, rank=plan.rank, name=name
            )
            dtypes[name] = info.dtype
            del weights
    yield from ingraph_tensors(
        families,
        stack=stack,
        gemm=plan.path == "gemm",
        fuse=plan.options.qkv_fuse,
        dtype=dtypes,
    )


def _checked_nvfp4(plan: StatePlan, ckpt: ThetaCheckpoint, name: str) -> Iterator[Any]:
    """The stored NVFP4 ``W0`` of each band of ``name``, its scales checked (see
    :meth:`theta_state`)."""
    for band in range(max(ckpt.families[name]["bands"]) + 1):
        q = ckpt.nvfp4(name, band)
        scale = q.weight_scale.view(np.uint8)
        scale_2 = np.asarray(q.weight_scale_2, np.float32).reshape(1)
        if ((scale & 0x7F) == 0x7F).any():
            raise CheckpointError(
                f"{plan.model_path}: {nvfp4_key(name, band, 'scale')} holds NaN block "
                "scales (bytes 0x7F/0xFF)"
            )
        if not (np.isfinite(scale_2).all() and scale_2[0] > 0):
            raise CheckpointError(
                f"{plan.model_path}: {nvfp4_key(name, band, 'scale_2')} is {scale_2[0]}, "
                "not a finite positive scale"
            )
        yield q


def quantized_state(plan: StatePlan) -> Iterator[tuple[str, np.ndarray]]:
    """:meth:`state` with every projection ``W_eff`` quantized to NVFP4 (see below).

    A projection ``<prefix>.weight`` becomes ``<prefix>.weight`` (uint8 packed
    E2M1 codes ``[out, in/2]``), ``<prefix>.weight_scale`` (the float8_e4m3fn
    block scales as uint8 bytes ``[out, in/16]``) and ``<prefix>.weight_scale_2``
    (float32 ``[1]``), the layout ``attnquant_max``'s NVFP4 layers read.
    Every other tensor is unchanged, but the output head with ``ATTNQUANT_QUANT_HEAD=1``
    (:func:`with_nvfp4_head`). One projection is quantized at a time.

    Raises
    ------
    NVFP4Error
        A projection's input size is not a multiple of 16, or it holds NaN/Inf;
        the message names the key.
    """
    for key, array in _with_head(plan, dense_state(plan)):
        parsed = parse_projection_key(key)
        if parsed is None or not key.endswith(".weight"):
            yield key, array
            continue
        yield from _nvfp4_parts(key, quantize_nvfp4(array, name=key))


def _with_head(
    plan: StatePlan, items: Iterator[tuple[str, np.ndarray]]
) -> Iterator[tuple[str, np.ndarray]]:
    """``items``, the head quantized too where :attr:`head_nvfp4` and the embedding table where
    :attr:`embedding_nvfp4` (:func:`with_nvfp4_head`)."""
    if not plan.head_nvfp4:
        return items
    return with_nvfp4_head(items, model_path=plan.model_path, embedding=plan.embedding_nvfp4)


def dense_state(plan: StatePlan) -> Iterator[tuple[str, np.ndarray]]:
    """Every dense key of the model with its array (original names, source dtype)."""
    if plan.source == "theta":
        return ThetaCheckpoint.open(plan.model_path, blocks=plan.options.blocks).rebuilt_state()
    if plan.blocks == "layers":
        ckpt = open_checkpoint(plan.model_path)
        return ((key, ckpt.get(key)) for key in ckpt.keys())
    return rebuild_dense_state(open_checkpoint(plan.model_path), blocks=plan.blocks, rank=plan.rank)
