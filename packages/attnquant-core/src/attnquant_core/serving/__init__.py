"""What serving a checkpoint means, decided without MAX: the options of a load.

:class:`ServingOptions` is the one typed value every serving command builds once (from CLI flags,
or the ``ATTNQUANT_*`` variables for compatibility) and attnquant-max turns into a plan per load;
:data:`OPTIONS` describes each option (flag, variable, default, meaning) and
:func:`options_table` renders them for the README (docs/serving-paths.md).
"""

from ._options import (
    LEGACY_PATH_VARIABLES,
    OPTIONS,
    PATH_CHOICES,
    ConfigError,
    OptionSpec,
    PathChoice,
    ServingOptions,
    options_table,
    parse_blocks,
)

__all__ = [
    "LEGACY_PATH_VARIABLES",
    "OPTIONS",
    "PATH_CHOICES",
    "ConfigError",
    "OptionSpec",
    "PathChoice",
    "ServingOptions",
    "options_table",
    "parse_blocks",
]
