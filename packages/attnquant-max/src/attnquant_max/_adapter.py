"""The weight adapter of attnquant's MAX architectures: one plan, its state, checked keys.

At load :class:`ThetaWeightAdapter`

1. finds the model directory and makes the plan once from the options it carries
   (:func:`attnquant_max.plan_serving`): a theta checkpoint is rebuilt from its theta keys or
   served in the graph; a dense one as it is, or decomposed at load when ``--blocks`` asks;
2. hands the state the plan implies, under the original Hugging Face names, to the stock
   adapter (so the key renaming stays MAX's), returned as a :class:`PlannedState` that carries
   the plan on to the graph builder;
3. checks the result: every weight the model reads is present and no theta key is left (the
   stock loader zero-fills a missing weight without a word).

Nothing here imports ``max.pipelines``: only ``max.graph.weights`` and ``max.driver``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnquant_core import FAMILIES, CheckpointError, is_theta_checkpoint
from attnquant_core.serving import HEAD_KEY, InGraphLayout, ServingOptions

from ._keys import (
    WeightKeyError,
    check_source_keys,
    check_state_keys,
    is_attnquant_key,
    listed,
)
from ._plan import IN_GRAPH_ARCHITECTURES, ServingPlan, log_serving_path, plan_serving
from ._refusals import REBUILD_AT_LOAD

__all__ = [
    "ArrayWeights",
    "PlannedState",
    "ThetaWeightAdapter",
    "model_directory",
    "rebuilt_weights",
    "weight_data_from_numpy",
    "wrap_weight_adapter",
]

logger = logging.getLogger(__name__)


class PlannedState(dict):
    """The state a weight adapter hands to MAX, carrying the plan it was made under.

    MAX keeps the adapter's return value as the pipeline model's ``state_dict``, so the graph
    builder (:class:`attnquant_max.architectures.llama3.ThetaLlama3Model`) reads the same plan instead of
    deciding again.
    """

    plan: ServingPlan | None = None

    def __init__(self, items: Any = (), plan: ServingPlan | None = None) -> None:
        super().__init__(items)
        self.plan = plan


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


# -- the adapter --------------------------------------------------------------------------

WeightsAdapter = Callable[..., dict[str, Any]]
ExpectedKeys = Callable[[Any, Mapping[str, Any]], Iterable[str]]


def rebuilt_weights(
    state_dict: Mapping[str, Any],
    pipeline_config: Any,
    *,
    options: ServingOptions | None = None,
    in_graph: bool = False,
    name: str = "",
) -> tuple[dict[str, Any], ServingPlan]:
    """The state MAX should load instead of ``state_dict``, and the plan behind it.

    ``state_dict`` is returned unchanged when nothing is rebuilt (a dense
    checkpoint at passthrough). On an in-graph path the state holds the theta
    tensors (:meth:`ServingPlan.theta_state`); ``in_graph`` says whether the
    architecture ``name`` builds such a model, and the load is refused if not. ``options``
    default to the ``ATTNQUANT_*`` variables of this process (what a ``max serve`` child got).
    """
    path = model_directory(pipeline_config, state_dict)
    if not is_theta_checkpoint(path):
        stray = [key for key in state_dict if is_attnquant_key(key)]
        if stray:
            raise WeightKeyError(
                f"{path}: holds {len(stray)} theta key(s) but no attnquant.json, so it can be "
                f"served neither as a theta checkpoint nor as a dense one: {listed(stray)}. "
                "Restore attnquant.json from the decomposition output."
            )
    plan = plan_serving(path, ServingOptions.from_env() if options is None else options)
    log_serving_path(plan)
    served_in_graph = {  # what only an in-graph architecture (Llama's, Gemma 3 text's) builds
        "nvfp4": ("a checkpoint whose W0 is NVFP4", plan.theta_state, " and no --quant"),
        "quantized": (
            f"--quant {plan.options.quant} (ATTNQUANT_QUANT)",
            plan.quantized_state,
            ", or write an NVFP4 checkpoint with `attnquant export --format nvfp4` for a server "
            "that reads Model Optimizer's layout",
        ),
        "in_graph": (f"the {plan.path} path (in-graph theta)", plan.theta_state, ""),
    }
    kind = next(
        (
            k
            for k, on in zip(
                served_in_graph, (plan.nvfp4_w0, plan.quantized, plan.in_graph), strict=True
            )
            if on
        ),
        None,
    )
    if kind is not None:
        what, state, more = served_in_graph[kind]
        if not in_graph:
            raise NotImplementedError(
                f"{name or 'this architecture'}: {what} is served for "
                f"{', '.join(IN_GRAPH_ARCHITECTURES)} only; "
                f"serve it with {REBUILD_AT_LOAD}{more}"
            )
        return {key: ArrayWeights(key, array) for key, array in state()}, plan
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
    options : ServingOptions or None
        What every load through this adapter serves; ``None`` reads the ``ATTNQUANT_*``
        variables of the process once per load (a ``max serve`` child's boundary).
    """

    stock: WeightsAdapter | None
    expected: ExpectedKeys
    name: str = ""
    in_graph: bool = False
    options: ServingOptions | None = field(default=None)

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
            state_dict,
            pipeline_config,
            options=self.options,
            in_graph=self.in_graph,
            name=self.name,
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
        if plan.embedding_nvfp4:  # a tied table is not handed on: the lookup reads the head's
            tied = {k for k in expected if k.endswith("embed_tokens.weight") and k not in out}
            expected = expected - tied | ({HEAD_KEY} if tied else set())
        theta: set[str] = set()
        shapes = {k: [int(d) for d in v.shape] for k, v in out.items()}
        if plan.in_graph:
            layout = InGraphLayout.from_state(shapes, FAMILIES, fuse=plan.options.qkv_fuse)
            if layout is None and plan.path != "gemm":
                raise WeightKeyError(f"{plan.model_path}: the in-graph state holds no theta tensor")
            if layout is not None:  # GEMM with every layer served dense: the stock model
                num_layers = int(getattr(huggingface_config, "num_hidden_layers", plan.num_layers))
                theta = layout.keys(num_layers)
                expected = {k for k in expected if not k.endswith(_PROJECTION_WEIGHTS)}
        check_state_keys(out, expected, model_path=plan.model_path, theta=theta)
        return PlannedState(out, plan)


_PROJECTION_WEIGHTS = tuple(f"{family}.weight" for family in FAMILIES)


def wrap_weight_adapter(
    stock: WeightsAdapter | None,
    expected: ExpectedKeys,
    *,
    name: str = "",
    in_graph: bool = False,
    options: ServingOptions | None = None,
) -> ThetaWeightAdapter:
    """Wrap ``stock`` into a :class:`ThetaWeightAdapter` (see there)."""
    return ThetaWeightAdapter(stock, expected, name, in_graph, options)
