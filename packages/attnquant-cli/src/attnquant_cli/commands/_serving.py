"""The serving flags every command that loads a model through MAX takes, built into one value.

:func:`serving_flags` adds one typer option per entry of
:data:`attnquant_core.serving.OPTIONS` to a command (``--path``, ``--quant``, ...) and hands the
command one :class:`~attnquant_core.serving.ServingOptions` built once from them: a flag given
wins over its ``ATTNQUANT_*`` variable, a variable over the default.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from attnquant_core.serving import (
    MAX_NICE,
    OPTIONS,
    PATH_CHOICES,
    OptionSpec,
    ServingOptions,
    parse_blocks,
)

__all__ = ["serving_flags"]

_CHOICES = {
    "path": PATH_CHOICES,
    "quant": ("nvfp4",),
    "nvfp4_kernel": ("auto", "fused", "dequantize"),
}


def _annotation(spec: OptionSpec) -> Any:
    """The typer annotation of one serving option (unset by default: the variable decides)."""
    help_text = f"{spec.help} [env: {spec.variable}; default: {spec.default}]"
    names = spec.flag.split("/") if "/" in spec.flag else [spec.flag]
    if spec.field in _CHOICES:
        metavar = "|".join(_CHOICES[spec.field])
        return Annotated[str | None, typer.Option(*names, metavar=metavar, help=help_text)]
    if spec.field == "rank":
        return Annotated[int | None, typer.Option(*names, min=0, help=help_text)]
    if spec.field == "worker_nice":
        return Annotated[int | None, typer.Option(*names, min=0, max=MAX_NICE, help=help_text)]
    if spec.field == "blocks":
        return Annotated[str | None, typer.Option(*names, metavar="G|layers", help=help_text)]
    flag = typer.Option(f"{names[0]}/{names[1]}" if len(names) == 2 else names[0], help=help_text)
    return Annotated[bool | None, flag]


_PARAMETERS = [
    inspect.Parameter(
        spec.field, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_annotation(spec)
    )
    for spec in OPTIONS
]


def serving_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` with the serving flags added, called with ``options=ServingOptions(...)``."""
    signature = inspect.signature(command, eval_str=True)
    kept = [p for p in signature.parameters.values() if p.name != "options"]
    kept = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in kept]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        flags = {spec.field: kwargs.pop(spec.field, None) for spec in OPTIONS}
        if flags["blocks"] is not None:
            flags["blocks"] = parse_blocks("--blocks", flags["blocks"])
        return command(**kwargs, options=ServingOptions.from_sources(flags))

    wrapper.__signature__ = signature.replace(parameters=[*kept, *_PARAMETERS])  # type: ignore[attr-defined]
    del wrapper.__wrapped__  # typer reads this signature, not the command's
    wrapper.__annotations__ = {p.name: p.annotation for p in [*kept, *_PARAMETERS]}
    return wrapper
