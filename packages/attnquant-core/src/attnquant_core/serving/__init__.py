"""What serving a checkpoint means, decided without MAX: the options of a load and its state.

:class:`ServingOptions` is the one typed value every serving command builds once (from CLI flags,
or the ``ATTNQUANT_*`` variables for compatibility) and attnquant-max turns into a plan per load;
:data:`OPTIONS` describes each option (flag, variable, default, meaning) and
:func:`options_table` renders them for the README (docs/serving-paths.md).

The state a plan hands to MAX is prepared here too, in numpy: how each layer of a family is
served in the graph (:func:`served_layers`, :class:`Served`), the in-graph tensors and their
names (:func:`ingraph_tensors`, :func:`nvfp4_tensors`), the layout read back from a state's
names and shapes (:class:`InGraphLayout`), and the state itself (:func:`theta_state`,
:func:`quantized_state`, :func:`dense_state`, :func:`with_nvfp4_head`, over any plan that
satisfies :class:`StatePlan`). attnquant-max builds the MAX graphs from them.
"""

from ._layout import InGraphLayout
from ._options import (
    DEFAULT_WORKER_NICE,
    LEGACY_PATH_VARIABLES,
    MAX_NICE,
    OPTIONS,
    PATH_CHOICES,
    ConfigError,
    OptionSpec,
    PathChoice,
    ServingOptions,
    options_table,
    parse_blocks,
)
from ._served import (
    FACTORED_KINDS,
    FUSED_GROUPS,
    GEMM_PREFIX,
    KINDS,
    STAGE1_KINDS,
    Served,
    fused_group_of,
    gemm_band_key,
    gemm_groups,
    is_nvfp4_family,
    served_layers,
    stacked_input_key,
)
from ._state import (
    HEAD_KEY,
    StatePlan,
    dense_state,
    quantized_state,
    theta_state,
    with_nvfp4_head,
)
from ._tensors import (
    banded_groups,
    ingraph_tensors,
    nvfp4_tensors,
    stacked_layers,
    uniform_ranks,
)

__all__ = [
    "DEFAULT_WORKER_NICE",
    "LEGACY_PATH_VARIABLES",
    "MAX_NICE",
    "OPTIONS",
    "PATH_CHOICES",
    "ConfigError",
    "OptionSpec",
    "PathChoice",
    "ServingOptions",
    "options_table",
    "parse_blocks",
    # how each layer is served in the graph, and the tensors it reads (numpy)
    "FACTORED_KINDS",
    "FUSED_GROUPS",
    "GEMM_PREFIX",
    "KINDS",
    "STAGE1_KINDS",
    "InGraphLayout",
    "Served",
    "banded_groups",
    "fused_group_of",
    "gemm_band_key",
    "gemm_groups",
    "ingraph_tensors",
    "is_nvfp4_family",
    "nvfp4_tensors",
    "served_layers",
    "stacked_input_key",
    "stacked_layers",
    "uniform_ranks",
    # the state a plan hands to MAX
    "HEAD_KEY",
    "StatePlan",
    "dense_state",
    "quantized_state",
    "theta_state",
    "with_nvfp4_head",
]
