"""Precompute-outside (DESIGN §5.1): rebuild every ``W_eff`` at load, check the keys.

The MAX architectures of this package wrap the stock weight adapters with
:func:`wrap_weight_adapter`. At load it

1. finds the model directory and decides, from ``ATTNQUANT_*`` and the checkpoint,
   what to serve (:func:`plan_serving`): a theta checkpoint is rebuilt from its
   theta keys; a dense one is served as is at passthrough, or decomposed at load
   and rebuilt when ``ATTNQUANT_BLOCKS`` asks for ``G < L``;
2. hands the rebuilt state, under the original Hugging Face names, to the stock
   adapter, so the key renaming stays MAX's and the graph is the base model's;
3. checks the adapter's output: every weight the stock model expects is present
   and no theta key is left. The stock loader zero-fills a missing weight
   without a word, so this check is what stands between a broken checkpoint and
   a server that produces text from zeros.

Nothing here imports ``max.pipelines``: the adapter receives MAX objects and uses
only ``max.graph.weights`` and ``max.driver``.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from attnquant_core import (
    FAMILIES,
    MANIFEST_FILE,
    CheckpointError,
    ThetaCheckpoint,
    decompose_family,
    dtype_from_name,
    is_theta_checkpoint,
    open_checkpoint,
    parse_projection_key,
    rebuild_dense_state,
)
from attnquant_core.io import nvfp4_key

from ._config import (
    CUSTOM_OP_MAX_RANK,
    PATH_DESCRIPTIONS,
    AttnquantConfig,
    ServingPath,
    _accelerator_api,
    require_implemented,
    serving_path,
)
from ._layout import InGraphLayout, ingraph_tensors
from ._tensors import nvfp4_tensors

__all__ = [
    "HEAD_KEY",
    "ServingPlan",
    "ThetaWeightAdapter",
    "WeightKeyError",
    "check_source_keys",
    "check_state_keys",
    "config_override",
    "expected_layer_type_keys",
    "expected_llama_keys",
    "log_serving_path",
    "model_directory",
    "plan_serving",
    "with_nvfp4_head",
    "wrap_weight_adapter",
]

logger = logging.getLogger(__name__)

#: What ``ATTNQUANT_QUANT=nvfp4`` serves, said once in the start-up log.
NVFP4_EMULATED = (
    "ATTNQUANT_QUANT=nvfp4: each W_eff quantized to NVFP4 at load (E2M1 codes, E4M3 scale per "
    "16 inputs, FP32 per-tensor scale) and held packed; per ATTNQUANT_NVFP4_KERNEL either "
    "dequantized inside the graph then a float32 matmul, or one fused generated_linear_nvfp4 "
    "dispatch decoding the packed bytes in registers (auto: the faster, timed at start-up); no "
    "native FP4 matmul is used"
)

#: How each form of ``ATTNQUANT_NVFP4_KERNEL`` runs a projection of an NVFP4-``W0`` checkpoint.
_NVFP4_THETA_KERNEL = {
    "fused": "each projection one generated_linear_nvfp4(x, W0_packed, W0_scale, W0_scale_2, s, "
    "U, V) dispatch, W0 decoded in registers (ATTNQUANT_NVFP4_KERNEL=fused)",
    "dequantize": "W0 dequantized in the graph, then s*(x W0^T) + (x V) U^T "
    "(ATTNQUANT_NVFP4_KERNEL=dequantize)",
    "auto": "each projection one fused generated_linear_nvfp4 dispatch or W0 dequantized in the "
    "graph then s*(x W0^T) + (x V) U^T, the faster as timed at start-up "
    "(ATTNQUANT_NVFP4_KERNEL=auto)",
}

#: How many offending keys an error message lists before it says "and N more".
_MAX_LISTED = 24

#: The output head of a Hugging Face Llama checkpoint (``ATTNQUANT_QUANT_HEAD`` quantizes it).
HEAD_KEY = "lm_head.weight"
_EMBEDDING_KEY = "embed_tokens.weight"

#: What ``ATTNQUANT_QUANT_HEAD=1`` adds to the start-up line.
NVFP4_HEAD = (
    "the output head in NVFP4 too (ATTNQUANT_QUANT_HEAD=1; a tied head quantized from the "
    "embedding table, which stays float)"
)


def _nvfp4_parts(key: str, q: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The three tensors of an NVFP4 ``<prefix>.weight``, as :mod:`._nvfp4_layers` reads them."""
    prefix = key[: -len(".weight")]
    yield key, q.weight
    yield f"{prefix}.weight_scale", q.weight_scale.view(np.uint8)
    yield f"{prefix}.weight_scale_2", np.asarray(q.weight_scale_2, np.float32).reshape(1)


def with_nvfp4_head(
    items: Iterable[tuple[str, np.ndarray]], *, model_path: str | Path = ""
) -> Iterator[tuple[str, np.ndarray]]:
    """``items`` with the output head ``lm_head.weight`` quantized to NVFP4 (three tensors).

    A tied model has no ``lm_head.weight``: its head is quantized from the embedding table,
    which is passed on unchanged (the embedding gathers float rows; the head reads 4.5 bits per
    weight). Everything else passes unchanged.

    Raises
    ------
    CheckpointError
        Neither a head nor an embedding table to quantize it from.
    NVFP4Error
        The head holds NaN/Inf, or its input size is not a multiple of 16.
    """
    from ._nvfp4 import quantize_nvfp4

    embedding: tuple[str, np.ndarray] | None = None
    head = False
    for key, array in items:
        if key == HEAD_KEY:
            head = True
            yield from _nvfp4_parts(key, quantize_nvfp4(array, name=key))
            continue
        if key.endswith(_EMBEDDING_KEY) and embedding is None:
            embedding = (key, array)
        yield key, array
    if head:
        return
    if embedding is None:
        raise CheckpointError(
            f"{model_path}: ATTNQUANT_QUANT_HEAD=1 found neither {HEAD_KEY} nor an "
            f"{_EMBEDDING_KEY} (a tied head) to quantize"
        )
    yield from _nvfp4_parts(HEAD_KEY, quantize_nvfp4(embedding[1], name=embedding[0]))


class WeightKeyError(CheckpointError):
    """The state handed to MAX lacks a weight the model needs, or carries theta keys."""


def _is_attnquant_key(key: str) -> bool:
    return ".theta_" in key or key.startswith("attnquant.") or ".attnquant." in key


def _listed(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else ""
    return ", ".join(keys[:_MAX_LISTED]) + more


# -- what to serve -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ServingPlan:
    """What a load of ``model_path`` serves, decided once from the config and the checkpoint.

    Attributes
    ----------
    model_path : Path
        The checkpoint directory.
    source : "theta" or "dense"
        A theta checkpoint (``attnquant.json`` present) or a dense one.
    blocks : int or "layers"
        ``G`` of the weights served; ``"layers"`` for a dense checkpoint at passthrough.
    rank : int
        ``r`` of the correction (``0`` for a dense checkpoint at passthrough).
    num_layers : int
        Decoder layers ``L``.
    path : str
        The execution path (:func:`attnquant_max.serving_path`):
        ``"precompute-outside"``, ``"gemm"`` or ``"precompute"`` (in-graph).
    accelerator_api : str or None
        What ``max.driver.accelerator_api()`` said, when it decided the path.
    forms : dict of str to str
        A theta checkpoint's form per family (``banded``, ``lowrank``,
        ``shared_basis``); empty for a dense checkpoint. ``blocks`` is ``None``
        when the families do not share one banded ``G``.
    reason : str or None
        Why the path was chosen, when not from ``ATTNQUANT_*`` and the accelerator alone.
    nvfp4_families : tuple of str
        The families of a theta checkpoint banded with a ``W0`` stored in NVFP4 (format version
        4), served in the graph as stored: the packed ``W0`` once per band, ``s``, ``U``, ``V``
        per layer, every other family as the GEMM path serves its form (:meth:`theta_state`;
        ``path`` is ``"gemm"``). Empty when there is none, and for such a checkpoint on the
        precompute-outside path without ``ATTNQUANT_QUANT`` (rebuilt dense instead).
    """

    model_path: Path
    source: Literal["theta", "dense"]
    blocks: int | Literal["layers"] | None
    rank: int
    num_layers: int
    path: ServingPath = "precompute-outside"
    accelerator_api: str | None = None
    forms: dict[str, str] = field(default_factory=dict)
    reason: str | None = None
    nvfp4_families: tuple[str, ...] = ()
    config: AttnquantConfig = field(repr=False)

    @property
    def nvfp4_w0(self) -> bool:
        """Whether some family's NVFP4 ``W0`` is served packed in the graph (:attr:`nvfp4_families`)."""
        return bool(self.nvfp4_families)

    @property
    def rebuilds(self) -> bool:
        """Whether the state MAX loads differs from the checkpoint's.

        ``False`` only for a dense checkpoint at passthrough on the
        precompute-outside path: its weights are served unchanged.
        """
        return self.in_graph or self.quantized or self.source == "theta" or self.blocks != "layers"

    @property
    def quantized(self) -> bool:
        """Whether each ``W_eff`` is quantized at load (``ATTNQUANT_QUANT=nvfp4``).

        ``False`` for a checkpoint whose ``W0`` is already NVFP4 (:attr:`nvfp4_w0`): it is
        served as stored, never quantized twice.
        """
        return self.config.quant is not None and not self.nvfp4_w0

    @property
    def head_nvfp4(self) -> bool:
        """Whether the output head is quantized to NVFP4 at load (``ATTNQUANT_QUANT_HEAD=1``
        beside NVFP4 projections, :attr:`quantized` or :attr:`nvfp4_w0`, or on an in-graph
        path, :attr:`in_graph`)."""
        return self.config.quant_head and (self.quantized or self.nvfp4_w0 or self.in_graph)

    @property
    def in_graph(self) -> bool:
        """Whether the graph holds the theta tensors (GEMM, in-graph precompute, custom op)."""
        return self.path in ("gemm", "precompute", "custom-op")

    def _why(self) -> str:
        if self.reason is not None:
            return self.reason
        if self.path == "precompute":
            return "ATTNQUANT_PRECOMPUTE=1"
        if self.config.gemm is not None:
            return f"ATTNQUANT_PRECOMPUTE_OUTSIDE=0, ATTNQUANT_GEMM={int(self.config.gemm)}"
        return (
            f"ATTNQUANT_PRECOMPUTE_OUTSIDE=0, ATTNQUANT_GEMM unset and accelerator API "
            f"{self.accelerator_api!r}"
        )

    @property
    def passthrough(self) -> bool:
        """Whether ``G = L``: each layer keeps its own ``W0`` and the rebuild is exact."""
        banded = all(form == "banded" for form in self.forms.values())
        return banded and (self.blocks == "layers" or self.blocks == self.num_layers)

    def describe(self) -> str:
        """One line for the start-up log."""
        where = f"{self.source} checkpoint {self.model_path}"
        if not self.rebuilds:
            return f"attnquant: serving {where} unchanged (passthrough, no rebuild)"
        g = "layers (passthrough)" if self.passthrough else str(self.blocks)
        if self.blocks is None or any(form != "banded" for form in self.forms.values()):
            counts = Counter(self.forms.values())
            g = f"{self.blocks} (forms: " + ", ".join(f"{n} {f}" for f, n in counts.items()) + ")"
        how = "theta keys" if self.source == "theta" else "decomposition at load"
        if self.nvfp4_w0:
            return self._describe_nvfp4(where, g)
        if self.in_graph:
            if self.path == "custom-op" and any(f != "banded" for f in self.forms.values()):
                fused = (
                    "one generated_linear per banded projection, one generated_lowrank per "
                    "low-rank or shared-basis one; an MLP in one generated_mlp where all three "
                    "are banded"
                    + ("" if self.config.fused_mlp else " (not: ATTNQUANT_FUSED_MLP=0)")
                )
            elif self.path == "custom-op":
                fused = (
                    "one generated_linear per projection; the MLP in one generated_mlp"
                    if self.config.fused_mlp
                    else "one generated_linear per projection (ATTNQUANT_FUSED_MLP=0)"
                )
            else:
                mixed = any(form != "banded" for form in self.forms.values())
                how_fused = (
                    ("fused where the forms allow" if mixed else "fused")
                    if self.config.qkv_fuse
                    else "separate (ATTNQUANT_QKV_FUSE=0)"
                )
                fused = f"q/k/v and gate/up {how_fused}"
            return (
                f"attnquant: serving {where} on the {PATH_DESCRIPTIONS[self.path]}; {fused}; "
                f"theta from {how}, G={g}, r={self.rank}, L={self.num_layers}; "
                f"chosen by {self._why()}" + (f"; {NVFP4_HEAD}" if self.head_nvfp4 else "")
            )
        line = (
            f"attnquant: serving {where} on the precompute-outside path: W_eff = s*W0 + U V^T "
            f"rebuilt once at load from {how}, G={g}, r={self.rank}, L={self.num_layers}"
        )
        if self.quantized:
            line += "; " + NVFP4_EMULATED
        return line + (f"; {NVFP4_HEAD}" if self.head_nvfp4 else "")

    def _describe_nvfp4(self, where: str, g: str) -> str:
        """:meth:`describe` of a checkpoint with NVFP4-``W0`` families: what each form runs as."""
        nvfp4 = self.nvfp4_families
        line = (
            f"attnquant: serving {where} in the graph holding its stored bytes: "
            f"{len(nvfp4)} famil{'y' if len(nvfp4) == 1 else 'ies'} ({', '.join(nvfp4)}) banded "
            f"with an NVFP4 W0 held packed as stored (E2M1 codes, E4M3 scale per 16 inputs, "
            f"FP32 per-tensor scale; one copy per band, 4.5 bits per weight; not dequantized at "
            f"load) with s, U, V per layer: {_NVFP4_THETA_KERNEL[self.config.nvfp4_kernel]}"
        )
        other = {n: f for n, f in self.forms.items() if n not in nvfp4}
        if other:
            counts = Counter("banded (float W0)" if f == "banded" else f for f in other.values())
            fuse = (
                "q/k/v and gate/up fused where the forms allow, per member in a group with an "
                "NVFP4 member"
                if self.config.qkv_fuse
                else "separate (ATTNQUANT_QKV_FUSE=0)"
            )
            line += (
                "; "
                + ", ".join(f"{n} {f}" for f, n in counts.items())
                + f" on the GEMM path as stored ({fuse})"
            )
        line += f"; G={g}, r={self.rank}, L={self.num_layers}; chosen by {self._why()}"
        return line + (f"; {NVFP4_HEAD}" if self.head_nvfp4 else "")

    def theta_state(self) -> Iterator[tuple[str, np.ndarray]]:
        """In-graph paths: every tensor the theta model reads (original names, source dtype);
        with :attr:`head_nvfp4`, the output head quantized (:func:`with_nvfp4_head`).

        The checkpoint's other tensors (embeddings, norms, head), then the
        theta tensors of :func:`attnquant_max._layout.ingraph_tensors`: ``W0V``
        band weights and every other form's factors (or, where they are not smaller,
        the layer's dense weight rebuilt once) on the GEMM path, ``W0`` and ``theta_V`` on
        the in-graph precompute path. A dense checkpoint is decomposed here, with
        ``G``, ``r`` of the plan (passthrough: ``W0 = W``, ``s = 1``, no correction).
        Every float family is held in memory at once (q/k/v share band weights); the families
        of :attr:`nvfp4_families` are read one band and one layer at a time and handed on as
        stored (:func:`attnquant_max._tensors.nvfp4_tensors`): nothing is dequantized.

        Raises
        ------
        attnquant_core.CheckpointError
            An NVFP4 block scale byte is NaN (0x7F/0xFF) or a per-tensor scale is not finite
            and positive; the message names the key.
        """
        return self._with_head(self._theta_tensors())

    def _theta_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """:meth:`theta_state` before the head is quantized."""
        families: dict[str, Any] = {}
        dtypes: dict[str, np.dtype] = {}
        if self.source == "theta":
            ckpt = ThetaCheckpoint.open(self.model_path, blocks=self.config.blocks)
            for key in ckpt.copied_keys():
                yield key, ckpt.tensors.get(key)
            stack = ckpt.stack
            for name, fam in ckpt.families.items():
                dtype = dtype_from_name(fam.get("source_dtype", fam["dtype"]))
                if name in self.nvfp4_families:
                    yield from nvfp4_tensors(
                        name,
                        projection=ckpt.projection_of(name),
                        stack=stack,
                        bands=self._checked_nvfp4(ckpt, name),
                        layers=((i, ckpt.layer(name, i)) for i in ckpt.layers_of(name)),
                        cast=lambda a, dtype=dtype: np.ascontiguousarray(
                            a.astype(dtype, copy=False)
                        ),
                    )
                    continue
                families[name] = ckpt.family_theta(name)
                dtypes[name] = dtype
        else:
            dense = open_checkpoint(self.model_path)
            projection_keys = dense.projection_keys()
            for key in dense.keys():
                if key not in projection_keys:
                    yield key, dense.get(key)
            stacks = {info.stack for info in dense.families.values()}
            if len(stacks) != 1:
                raise CheckpointError(
                    f"{self.model_path}: projection families under several stacks {sorted(stacks)}"
                )
            stack = stacks.pop()
            for name, info in dense.families.items():
                weights = [dense.get(k, check_finite=True) for k in info.keys]
                families[name], _ = decompose_family(
                    weights, blocks=self.blocks, rank=self.rank, name=name
                )
                dtypes[name] = info.dtype
                del weights
        yield from ingraph_tensors(
            families,
            stack=stack,
            gemm=self.path == "gemm",
            fuse=self.config.qkv_fuse,
            dtype=dtypes,
        )

    def _checked_nvfp4(self, ckpt: ThetaCheckpoint, name: str) -> Iterator[Any]:
        """The stored NVFP4 ``W0`` of each band of ``name``, its scales checked (see
        :meth:`theta_state`)."""
        for band in range(max(ckpt.families[name]["bands"]) + 1):
            q = ckpt.nvfp4(name, band)
            scale = q.weight_scale.view(np.uint8)
            scale_2 = np.asarray(q.weight_scale_2, np.float32).reshape(1)
            if ((scale & 0x7F) == 0x7F).any():
                raise CheckpointError(
                    f"{self.model_path}: {nvfp4_key(name, band, 'scale')} holds NaN block "
                    "scales (bytes 0x7F/0xFF)"
                )
            if not (np.isfinite(scale_2).all() and scale_2[0] > 0):
                raise CheckpointError(
                    f"{self.model_path}: {nvfp4_key(name, band, 'scale_2')} is {scale_2[0]}, "
                    "not a finite positive scale"
                )
            yield q

    def quantized_state(self) -> Iterator[tuple[str, np.ndarray]]:
        """:meth:`state` with every projection ``W_eff`` quantized to NVFP4 (see below).

        A projection ``<prefix>.weight`` becomes ``<prefix>.weight`` (uint8 packed
        E2M1 codes ``[out, in/2]``), ``<prefix>.weight_scale`` (the float8_e4m3fn
        block scales as uint8 bytes ``[out, in/16]``) and ``<prefix>.weight_scale_2``
        (float32 ``[1]``), the layout :mod:`attnquant_max._nvfp4_layers` reads.
        Every other tensor is unchanged, but the output head with ``ATTNQUANT_QUANT_HEAD=1``
        (:func:`with_nvfp4_head`). One projection is quantized at a time.

        Raises
        ------
        NVFP4Error
            A projection's input size is not a multiple of 16, or it holds NaN/Inf;
            the message names the key.
        """
        from ._nvfp4 import quantize_nvfp4

        for key, array in self._with_head(self.state()):
            parsed = parse_projection_key(key)
            if parsed is None or not key.endswith(".weight"):
                yield key, array
                continue
            yield from _nvfp4_parts(key, quantize_nvfp4(array, name=key))

    def _with_head(
        self, items: Iterator[tuple[str, np.ndarray]]
    ) -> Iterator[tuple[str, np.ndarray]]:
        """``items``, the head quantized too where :attr:`head_nvfp4` (:func:`with_nvfp4_head`)."""
        return with_nvfp4_head(items, model_path=self.model_path) if self.head_nvfp4 else items

    def state(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every dense key of the model with its array (original names, source dtype)."""
        if self.source == "theta":
            return ThetaCheckpoint.open(self.model_path, blocks=self.config.blocks).rebuilt_state()
        if self.blocks == "layers":
            ckpt = open_checkpoint(self.model_path)
            return ((key, ckpt.get(key)) for key in ckpt.keys())
        return rebuild_dense_state(
            open_checkpoint(self.model_path), blocks=self.blocks, rank=self.rank
        )


_override: list[AttnquantConfig] = []


@contextmanager
def config_override(config: AttnquantConfig) -> Iterator[AttnquantConfig]:
    """Within the block, loads in this process use ``config`` instead of ``ATTNQUANT_*``.

    For in-process loads (:func:`attnquant_max.load_pipeline`); a ``max serve``
    subprocess reads its environment.
    """
    _override.append(config)
    try:
        yield config
    finally:
        _override.pop()


def current_config() -> AttnquantConfig:
    """The innermost :func:`config_override`, else the ``ATTNQUANT_*`` variables."""
    return _override[-1] if _override else AttnquantConfig.from_env()


def plan_serving(model_path: str | Path, config: AttnquantConfig | None = None) -> ServingPlan:
    """Decide what serving ``model_path`` means under ``config`` (``ATTNQUANT_*`` by default).

    A theta checkpoint is opened and validated at once (its keys against its
    bands, and against ``ATTNQUANT_BLOCKS`` when that is set), so a mismatch fails
    here, listing the layers, before MAX builds anything. For a dense checkpoint
    an unset ``ATTNQUANT_BLOCKS`` means passthrough, the production default.
    ``config`` defaults to :func:`current_config`.

    Raises
    ------
    NotImplementedError
        ``config`` asks for a path this release does not serve.
    attnquant_core.CheckpointError
        The checkpoint cannot be read; ``BandMismatchError`` for a theta
        checkpoint whose keys do not match their bands.
    """
    config = current_config() if config is None else config
    path = Path(model_path)
    nvfp4 = _nvfp4_families(path)
    stock_graph = config.quant is None and serving_path(config, "cpu") == "precompute-outside"
    if config.quant_head and stock_graph:
        raise NotImplementedError(
            f"{path}: ATTNQUANT_QUANT_HEAD=1 puts the output head in NVFP4 beside NVFP4 "
            "projections (ATTNQUANT_QUANT=nvfp4) or on the in-graph paths "
            "(ATTNQUANT_PRECOMPUTE_OUTSIDE=0), not in the stock graph of precompute-outside: "
            "set one of those, or unset ATTNQUANT_QUANT_HEAD"
        )
    if nvfp4 and (config.quant is not None or config.precompute or not config.precompute_outside):
        return _plan_nvfp4_w0(path, config, nvfp4)
    api = None
    if (config.precompute or not config.precompute_outside) and config.gemm is None:
        api = _accelerator_api()
    require_implemented(config, api)
    how: dict[str, Any] = {"path": serving_path(config, api), "accelerator_api": api}
    if is_theta_checkpoint(path):
        ckpt = ThetaCheckpoint.open(path, blocks=config.blocks)
        forms = ckpt.forms
        banded = [max(ckpt.ranks(n), default=0) for n, f in forms.items() if f == "banded"]
        if how["path"] == "custom-op" and config.gemm is None:
            how.update(_auto_custom_op(ckpt, api, max(banded, default=0)))
        _refuse_forms_off_gemm(path, how["path"], forms, ckpt.blocks)
        _refuse_grouped_in_graph(
            path, how["path"], [n for n, f in ckpt.families.items() if "layers" in f]
        )
        _check_custom_op_rank(how["path"], max(banded, default=0), path)
        return ServingPlan(
            model_path=path,
            source="theta",
            blocks=ckpt.blocks,
            rank=ckpt.rank,
            num_layers=ckpt.num_layers,
            forms=forms,
            config=config,
            **how,
        )
    blocks = "layers" if config.blocks is None else config.blocks
    rank = 0 if blocks == "layers" else config.rank
    num_layers = _dense_num_layers(path, serving=how["path"])
    _check_custom_op_rank(how["path"], rank, path)
    return ServingPlan(
        model_path=path,
        source="dense",
        blocks=blocks,
        rank=rank,
        num_layers=num_layers,
        config=config,
        **how,
    )


def _auto_custom_op(ckpt: ThetaCheckpoint, api: str | None, banded_rank: int) -> dict[str, str]:
    """Auto selection picked the custom op (CPU, Apple Metal): keep it where it serves this
    checkpoint and was measured faster, else the GEMM path; the reason for the log line.

    The custom op holds one band layout of ``W0`` blocks (banded families of one ``G``) and
    corrections up to ``r = 64``. For the forms without ``W0`` (``generated_lowrank``) it was
    measured on the CPU only: a 300M-parameter model fitted to ``--budget 0.5`` (low rank)
    decodes 1.337x [1.200, 1.521] as fast on the custom op as on the GEMM path, prefills a
    512-token prompt at 0.905x [0.832, 0.970] (``benchmarks/bench_compressed.py --shape 300m
    --variants "budget 0.5 custom-op" --against "budget 0.5" --pairs 8``, 2026-12-01, 2 cores):
    decode is where serving spends its steps.
    """
    where = f"ATTNQUANT_PRECOMPUTE_OUTSIDE=0, ATTNQUANT_GEMM unset and accelerator API {api!r}"
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
            "reason": f"{where}, and forms without W0: the custom op (generated_lowrank) "
            "decodes them faster than the GEMM path on the CPU (1.34x at budget 0.5, 300M)"
        }
    else:
        return {}
    return {"path": "gemm", "reason": f"{where}, and {why}"}


def _nvfp4_families(path: Path) -> list[str]:
    """The families of a theta checkpoint at ``path`` whose ``W0`` is NVFP4 (its manifest's
    ``quant``); empty for a dense checkpoint or one without (errors are left to the open)."""
    if not is_theta_checkpoint(path):
        return []
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        return sorted(n for n, f in manifest["families"].items() if f.get("quant") == "nvfp4")
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return []


def _plan_nvfp4_w0(path: Path, config: AttnquantConfig, nvfp4: list[str]) -> ServingPlan:
    """The plan of a checkpoint whose ``W0`` is NVFP4 on an in-graph path or with
    ``ATTNQUANT_QUANT=nvfp4``: its packed ``W0`` and ``s``, ``U``, ``V`` held in the graph.

    ``ATTNQUANT_QUANT=nvfp4`` asks for a 4-bit model, which the checkpoint already is: it is
    served as stored, so the correction ``U V^T`` fitted to the quantization error keeps its
    effect, rather than ``W_eff = s Q(W0) + U V^T`` being quantized a second time (which would
    quantize that correction away). The checkpoint's other families (any float form, as a
    ``--budget --quant nvfp4`` fit writes them) are served as the GEMM path serves them, in the
    same graph: a budget fit is served as it was fitted. Every other combination that would
    dequantize ``W0`` inside an in-graph path is refused in one line naming what to set.
    """
    families = ", ".join(nvfp4)
    stored = f"{path}: stores W0 in NVFP4 ({families})"
    rebuild = (
        "or rebuild W_eff once at load with ATTNQUANT_PRECOMPUTE_OUTSIDE=1, ATTNQUANT_PRECOMPUTE=0 "
        "and ATTNQUANT_QUANT unset (the defaults)"
    )
    if config.precompute:
        raise NotImplementedError(
            f"{stored}; in-graph precompute (ATTNQUANT_PRECOMPUTE=1) would form W_eff from a "
            "dequantized W0 on every forward. Set ATTNQUANT_PRECOMPUTE=0 and "
            f"ATTNQUANT_PRECOMPUTE_OUTSIDE=0 to serve W0 packed in the graph, {rebuild}"
        )
    if config.gemm is False:
        raise NotImplementedError(
            f"{stored}; the custom-op path (ATTNQUANT_GEMM=0: generated_linear, generated_mlp) "
            "reads a float W0. Unset ATTNQUANT_GEMM (or set it to 1) to serve each projection "
            "from the packed W0 (ATTNQUANT_NVFP4_KERNEL=fused: one generated_linear_nvfp4 "
            f"dispatch; dequantize: W0 dequantized in the graph), {rebuild}"
        )
    ckpt = ThetaCheckpoint.open(path, blocks=config.blocks)
    grouped = [n for n, f in ckpt.families.items() if "layers" in f]
    if grouped:
        raise NotImplementedError(
            f"{stored}; the in-graph NVFP4 path serves families of one shape across layers, and "
            f"this model's layers differ in shape ({', '.join(grouped)}). Serve it with "
            "ATTNQUANT_PRECOMPUTE_OUTSIDE=1 and ATTNQUANT_QUANT unset (the defaults), which "
            "rebuild every family once at load"
        )
    if config.precompute_outside:
        reason = (
            f"ATTNQUANT_QUANT={config.quant} on a checkpoint whose W0 is already NVFP4: served "
            "as stored, not quantized twice (its float families as stored too)"
        )
    else:
        gemm = "ATTNQUANT_GEMM=1" if config.gemm else "ATTNQUANT_GEMM unset"
        reason = (
            f"ATTNQUANT_PRECOMPUTE_OUTSIDE=0, {gemm} and a checkpoint whose W0 is NVFP4 (the "
            "custom op reads a float W0)"
        )
    return ServingPlan(
        model_path=path,
        source="theta",
        blocks=ckpt.blocks,
        rank=ckpt.rank,
        num_layers=ckpt.num_layers,
        path="gemm",
        forms=ckpt.forms,
        reason=reason,
        nvfp4_families=tuple(nvfp4),
        config=config,
    )


def _dense_num_layers(path: Path, *, serving: str) -> int:
    """``L`` of a dense checkpoint, its families checked by core.

    Gemma 4 31B's global layers have their own head size and no ``v_proj``
    (``global_head_dim``, ``attention_k_eq_v``): core groups its families by layer shape,
    which the precompute-outside path rebuilds like any other; the in-graph paths hold one
    band layout per family and do not serve grouped families.
    """
    ckpt = open_checkpoint(path)
    _refuse_grouped_in_graph(
        path, serving, [n for n, f in ckpt.families.items() if f.group is not None]
    )
    return ckpt.num_layers


def _refuse_grouped_in_graph(path: Path, serving: str, grouped: list[str]) -> None:
    """An in-graph path refuses families grouped by layer shape, naming them, in one line."""
    if serving == "precompute-outside" or not grouped:
        return
    raise NotImplementedError(
        f"{path}: the {serving} path (in-graph theta) serves families of one shape across "
        f"layers; this model's layers differ in shape ({', '.join(grouped)}). Serve it with "
        "ATTNQUANT_PRECOMPUTE_OUTSIDE=1 and ATTNQUANT_PRECOMPUTE=0 (the defaults), which "
        "rebuild every family once at load"
    )


def _refuse_forms_off_gemm(
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
            "Serve it on the GEMM path (ATTNQUANT_PRECOMPUTE_OUTSIDE=0 ATTNQUANT_GEMM=1), or "
            "rebuild it at load with ATTNQUANT_PRECOMPUTE_OUTSIDE=1 (the default)"
        )
    if serving != "precompute":
        return
    other = sorted(f"{n} ({f})" for n, f in forms.items() if f != "banded")
    if not other and blocks is not None:
        return
    what = ", ".join(other) if other else "banded families with different G"
    raise NotImplementedError(
        f"{path}: the {serving} path serves banded families with one G only; this checkpoint "
        f"has {what}. Serve it on the GEMM path (ATTNQUANT_PRECOMPUTE_OUTSIDE=0 "
        "ATTNQUANT_GEMM=1) or the custom op (ATTNQUANT_GEMM=0), or rebuild it at load with "
        "ATTNQUANT_PRECOMPUTE_OUTSIDE=1 (the default)"
    )


def _check_custom_op_rank(path: str, rank: int, model_path: Path) -> None:
    """The custom op serves ``r <= 64`` (attnquant-kernels' limit); say so at start-up."""
    if path == "custom-op":
        from attnquant_kernels import check_rank

        check_rank(rank, what=f"{model_path}: the custom-op path at")


_logged: set[str] = set()


def log_serving_path(plan: ServingPlan, *, level: int = logging.INFO) -> str:
    """Log, once per distinct plan, which path and which ``G``, ``r`` were chosen.

    Returns the line (logged or not), so a CLI can print it too.
    """
    line = plan.describe()
    if line not in _logged:
        _logged.add(line)
        logger.log(level, line)
    return line


# -- finding the model directory ------------------------------------------------------


def model_directory(pipeline_config: Any, state_dict: Mapping[str, Any] | None = None) -> Path:
    """The local checkpoint directory of a MAX load.

    ``pipeline_config.model.model_path`` is a local directory for a local
    checkpoint (MAX 26.7); for a Hugging Face repo id the directory holding the
    resolved weight files is used instead.

    Raises
    ------
    attnquant_core.CheckpointError
        Neither names a single local directory.
    """
    model = pipeline_config.model
    model_path = str(getattr(model, "model_path", "") or "")
    if model_path and Path(model_path).is_dir():
        return Path(model_path)
    parents: set[Path] = set()
    try:
        parents = {Path(p).resolve().parent for p in model.resolved_weight_paths()}
    except Exception as exc:  # MAX may need the network to resolve a repo id.
        logger.debug("could not resolve the weight paths of %s: %s", model_path, exc)
    if len(parents) == 1:
        return parents.pop()
    raise CheckpointError(
        f"attnquant serves local checkpoints: {model_path!r} is not a directory and its "
        f"weight files are not in one directory ({sorted(map(str, parents))}). Download "
        "the checkpoint and pass its directory as the model path."
    )


# -- numpy to MAX --------------------------------------------------------------------------


class ArrayWeights:
    """The part of MAX's ``Weights`` protocol the stock adapters use, over one numpy array."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name = name
        self._array = array

    def data(self) -> Any:
        return weight_data_from_numpy(self._array, self.name)

    def exists(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"ArrayWeights({self.name!r}, {self._array.dtype}{list(self._array.shape)})"


def weight_data_from_numpy(array: np.ndarray, name: str) -> Any:
    """``max.graph.weights.WeightData`` for ``array``, ``ml_dtypes`` bfloat16/float8 included.

    ``WeightData.from_numpy`` refuses the ``ml_dtypes`` types, so those are
    handed over as raw bytes and viewed in MAX's dtype.
    """
    from max.driver import Buffer
    from max.dtype import DType
    from max.graph.type import Shape
    from max.graph.weights import WeightData

    array = np.ascontiguousarray(array)
    dtype = {
        "bfloat16": DType.bfloat16,
        "float8_e4m3fn": DType.float8_e4m3fn,
        "float8_e5m2": DType.float8_e5m2,
    }.get(array.dtype.name)
    if dtype is None:  # a numpy dtype
        return WeightData.from_numpy(array, name)
    raw = array.view(np.uint16 if array.dtype.itemsize == 2 else np.uint8)
    buffer = Buffer.from_numpy(raw).view(dtype, list(array.shape))
    return WeightData(buffer, name, dtype, Shape(array.shape))


# -- key checks -----------------------------------------------------------------------------


def expected_llama_keys(hf_config: Any) -> set[str]:
    """Every weight the stock MAX Llama3 model reads, in MAX names (``model.`` stripped)."""
    L = int(hf_config.num_hidden_layers)
    keys = {"embed_tokens.weight", "norm.weight"}
    if not getattr(hf_config, "tie_word_embeddings", False):
        keys.add("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    per_layer += [f"{family}.weight" for family in FAMILIES]
    if getattr(hf_config, "attention_bias", False):
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if getattr(hf_config, "mlp_bias", False):
        per_layer += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    keys.update(f"layers.{i}.{suffix}" for i in range(L) for suffix in per_layer)
    return keys


_LAYER = re.compile(r"^(?P<stack>(?:.*\.)?layers)\.(?P<layer>\d+)\.(?P<rest>.+)$")


def expected_uniform_keys(keys: Iterable[str], num_layers: int) -> set[str]:
    """Keys a stack of identical decoder layers needs, inferred from ``keys``.

    Every per-layer weight seen in any layer (and every projection family) is
    expected in every layer ``0 .. num_layers-1``: a weight missing from one
    layer is caught; the global keys are taken as they are.
    """
    keys = list(keys)
    suffixes: dict[str, set[str]] = {}
    out: set[str] = set()
    for key in keys:
        m = _LAYER.match(key)
        if m is None or _is_attnquant_key(key):
            continue
        suffixes.setdefault(m["stack"], set()).add(m["rest"])
    for stack, rests in suffixes.items():
        rests |= {f"{family}.weight" for family in FAMILIES}
        out.update(f"{stack}.{i}.{rest}" for i in range(num_layers) for rest in rests)
    return out


def expected_layer_type_keys(
    keys: Iterable[str], num_layers: int, layer_types: Sequence[str] | None = None
) -> set[str]:
    """Keys a decoder stack needs when layers of one type are alike, inferred from ``keys``.

    Gemma 4's global layers differ from its sliding ones (another head size, no ``v_proj``
    when ``attention_k_eq_v``), so the layers are grouped by ``layer_types`` (the text
    config's; one group when ``None``) and every weight seen in a layer of a group is expected
    in every layer of that group, ``0 .. num_layers-1``. Global keys are taken as they are.
    """
    if layer_types is not None and len(layer_types) != num_layers:
        layer_types = None
    kind = (lambda i: layer_types[i]) if layer_types is not None else (lambda i: "")
    suffixes: dict[tuple[str, str], set[str]] = {}
    for key in keys:
        m = _LAYER.match(key)
        if m is None or _is_attnquant_key(key) or int(m["layer"]) >= num_layers:
            continue
        suffixes.setdefault((m["stack"], kind(int(m["layer"]))), set()).add(m["rest"])
    stacks = {stack for stack, _ in suffixes}
    return {
        f"{stack}.{i}.{rest}"
        for stack in stacks
        for i in range(num_layers)
        for rest in suffixes.get((stack, kind(i)), ())
    }


def source_keys(model_path: str | Path) -> set[str] | None:
    """The dense keys of the checkpoint a theta checkpoint was decomposed from, as its
    ``attnquant.json`` records them (``source.digests``); ``None`` when not recorded."""
    try:
        manifest = json.loads((Path(model_path) / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    digests = (manifest.get("source") or {}).get("digests")
    return set(digests) if isinstance(digests, dict) and digests else None


def check_source_keys(state: Mapping[str, Any], model_path: str | Path) -> None:
    """Fail unless the rebuilt ``state`` of a theta checkpoint has exactly its source's keys.

    A tensor dropped from a theta checkpoint (a norm, the embedding) would otherwise reach a
    stock loader that zero-fills it, or fail deep inside MAX; a key the source did not have
    would be ignored. Skipped when the manifest records no source.

    Raises
    ------
    WeightKeyError
        Listing every missing and every unexpected key.
    """
    expected = source_keys(model_path)
    if expected is None:
        return
    missing = expected - state.keys()
    extra = {key for key in state.keys() - expected if not _is_attnquant_key(key)}
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} tensor(s) of the source checkpoint are not in this theta "
            f"checkpoint (the stock MAX loader would serve them as zeros): {_listed(missing)}"
        )
    if extra:
        parts.append(f"{len(extra)} tensor(s) the source checkpoint did not have: {_listed(extra)}")
    raise WeightKeyError(f"{model_path}: " + "; ".join(parts))


def check_state_keys(
    state: Mapping[str, Any],
    expected: Iterable[str],
    *,
    model_path: str | Path = "",
    theta: Iterable[str] = (),
) -> None:
    """Fail unless ``state`` has every ``expected`` and ``theta`` key and no other theta key.

    ``theta`` names the theta tensors an in-graph model reads (empty on the
    precompute-outside path, where any theta key is an error).

    Raises
    ------
    WeightKeyError
        Listing every missing weight and every leftover theta/shared key.
    """
    theta = set(theta)
    missing = (set(expected) | theta) - state.keys()
    leftover = {key for key in state if _is_attnquant_key(key) and key not in theta}
    if not missing and not leftover:
        return
    where = f"{model_path}: " if model_path else ""
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} weight(s) the model needs are missing (the stock MAX loader "
            f"would serve them as zeros): {_listed(missing)}"
        )
    if leftover:
        parts.append(
            f"{len(leftover)} theta key(s) are left that the stock model cannot use "
            f"(a theta checkpoint without its attnquant.json?): {_listed(leftover)}"
        )
    raise WeightKeyError(where + "; ".join(parts))


# -- the adapter --------------------------------------------------------------------------

WeightsAdapter = Callable[..., dict[str, Any]]
ExpectedKeys = Callable[[Any, Mapping[str, Any]], Iterable[str]]


def rebuilt_weights(
    state_dict: Mapping[str, Any],
    pipeline_config: Any,
    *,
    in_graph: bool = False,
    name: str = "",
) -> tuple[dict[str, Any], ServingPlan]:
    """The state MAX should load instead of ``state_dict``, and the plan behind it.

    ``state_dict`` is returned unchanged when nothing is rebuilt (a dense
    checkpoint at passthrough). On an in-graph path the state holds the theta
    tensors (:meth:`ServingPlan.theta_state`); ``in_graph`` says whether the
    architecture ``name`` builds such a model, and the load is refused if not.
    """
    path = model_directory(pipeline_config, state_dict)
    if not is_theta_checkpoint(path):
        stray = [key for key in state_dict if _is_attnquant_key(key)]
        if stray:
            raise WeightKeyError(
                f"{path}: holds {len(stray)} theta key(s) but no attnquant.json, so it can be "
                f"served neither as a theta checkpoint nor as a dense one: {_listed(stray)}. "
                "Restore attnquant.json from the decomposition output."
            )
    plan = plan_serving(path)
    log_serving_path(plan)
    if plan.nvfp4_w0:
        if not in_graph:
            raise NotImplementedError(
                f"{name or 'this architecture'}: a checkpoint whose W0 is NVFP4 is served in the "
                "graph for LlamaForCausalLM only; unset ATTNQUANT_QUANT and set "
                "ATTNQUANT_PRECOMPUTE_OUTSIDE=1 (the defaults) to rebuild W_eff once at load"
            )
        return {key: ArrayWeights(key, array) for key, array in plan.theta_state()}, plan
    if plan.quantized:
        if not in_graph:
            raise NotImplementedError(
                f"{name or 'this architecture'}: ATTNQUANT_QUANT={plan.config.quant} serving is "
                "implemented for LlamaForCausalLM only; unset ATTNQUANT_QUANT, or write an "
                "NVFP4 checkpoint with `attnquant export --format nvfp4` for a server that "
                "reads Model Optimizer's layout"
            )
        return {key: ArrayWeights(key, array) for key, array in plan.quantized_state()}, plan
    if plan.in_graph:
        if not in_graph:
            raise NotImplementedError(
                f"{name or 'this architecture'}: the {plan.path} path (in-graph theta) is "
                "implemented for LlamaForCausalLM only. Set ATTNQUANT_PRECOMPUTE_OUTSIDE=1 and "
                "ATTNQUANT_PRECOMPUTE=0 (the defaults) to rebuild W_eff once at load."
            )
        return {key: ArrayWeights(key, array) for key, array in plan.theta_state()}, plan
    if not plan.rebuilds:
        return dict(state_dict), plan
    weights = {key: ArrayWeights(key, array) for key, array in plan.state()}
    if plan.source == "theta":
        check_source_keys(weights, plan.model_path)
    return weights, plan


@dataclass(frozen=True)
class ThetaWeightAdapter:
    """A MAX weight adapter that rebuilds ``W_eff`` at load, then runs ``stock`` and checks keys.

    A module-level class rather than a closure because ``max serve`` pickles the
    architecture into its model worker process.

    Attributes
    ----------
    stock : callable or None
        The architecture's own adapter (``state_dict, huggingface_config,
        pipeline_config, **kwargs -> dict[str, WeightData]``); ``None`` for an
        architecture that loads raw keys. Must be picklable (module-level).
    expected : callable
        ``(huggingface_config, adapted_state) -> keys`` the stock model needs, in
        the adapter's output names. Must be picklable (module-level).
    name : str
        The architecture, for messages.
    in_graph : bool
        The architecture builds the in-graph theta model (GEMM, in-graph
        precompute); else those paths are refused at load.
    """

    stock: WeightsAdapter | None
    expected: ExpectedKeys
    name: str = ""
    in_graph: bool = False

    def __call__(
        self,
        state_dict: dict[str, Any],
        huggingface_config: Any = None,
        pipeline_config: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        if pipeline_config is None:
            raise TypeError(f"the attnquant adapter of {self.name} needs pipeline_config")
        weights, plan = rebuilt_weights(
            state_dict, pipeline_config, in_graph=self.in_graph, name=self.name
        )
        if self.stock is None:
            out = {key: value.data() for key, value in weights.items()}
        else:
            out = self.stock(
                weights,
                huggingface_config=huggingface_config,
                pipeline_config=pipeline_config,
                **kwargs,
            )
        expected = set(self.expected(huggingface_config, out))
        theta: set[str] = set()
        shapes = {k: [int(d) for d in v.shape] for k, v in out.items()}
        if plan.in_graph:
            layout = InGraphLayout.from_state(shapes, FAMILIES, fuse=plan.config.qkv_fuse)
            if layout is None and plan.path != "gemm":
                raise WeightKeyError(f"{plan.model_path}: the in-graph state holds no theta tensor")
            if layout is not None:  # GEMM with every layer served dense: the stock model
                num_layers = int(getattr(huggingface_config, "num_hidden_layers", plan.num_layers))
                theta = layout.keys(num_layers)
                expected = {k for k in expected if not k.endswith(_PROJECTION_WEIGHTS)}
        check_state_keys(out, expected, model_path=plan.model_path, theta=theta)
        return out


_PROJECTION_WEIGHTS = tuple(f"{family}.weight" for family in FAMILIES)


def wrap_weight_adapter(
    stock: WeightsAdapter | None, expected: ExpectedKeys, *, name: str = "", in_graph: bool = False
) -> ThetaWeightAdapter:
    """Wrap ``stock`` into a :class:`ThetaWeightAdapter` (see there)."""
    return ThetaWeightAdapter(stock, expected, name, in_graph)
