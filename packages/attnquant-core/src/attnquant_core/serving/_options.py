"""Serving options: one typed value, built once from CLI flags or ``ATTNQUANT_*`` variables.

:class:`ServingOptions` is what every load of a checkpoint through attnquant's MAX
architectures receives: the CLI builds it from its flags (:meth:`ServingOptions.from_sources`:
a flag given wins over a variable, a variable over the default), a ``max serve`` child gets it
as canonical variables (:meth:`ServingOptions.to_env`) and reads it back once at import of the
architectures (:meth:`ServingOptions.from_env`), and the plan of a load
(:func:`attnquant_max.plan_serving`) is made from it once. :data:`OPTIONS` describes every
option (flag, variable, default, meaning); the README's options table is generated from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

__all__ = [
    "DEFAULT_WORKER_NICE",
    "LEGACY_PATH_VARIABLES",
    "MAX_NICE",
    "OPTIONS",
    "ConfigError",
    "OptionSpec",
    "PathChoice",
    "ServingOptions",
    "options_table",
]

PathChoice = Literal["auto", "precompute-outside", "in-graph", "gemm", "custom-op", "precompute"]
PATH_CHOICES: tuple[str, ...] = get_args(PathChoice)
Quant = Literal["nvfp4"]
NVFP4Kernel = Literal["auto", "fused", "dequantize"]
NVFP4_KERNELS: tuple[str, ...] = get_args(NVFP4Kernel)

#: The largest nice value Linux allows.
MAX_NICE = 19
#: The nice value MAX's CPU runtime workers get at load (``--worker-nice``): the highest, since
#: decode was fastest there on a 2-core machine (docs/decode-speed.md).
DEFAULT_WORKER_NICE = MAX_NICE

#: The variables that chose the path before ``ATTNQUANT_PATH`` (still read, never written).
LEGACY_PATH_VARIABLES = ("ATTNQUANT_PRECOMPUTE_OUTSIDE", "ATTNQUANT_PRECOMPUTE", "ATTNQUANT_GEMM")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_BOOL_ALLOWED = "one of 1/0, true/false, yes/no, on/off"


class ConfigError(ValueError):
    """A serving option (a flag or an ``ATTNQUANT_*`` variable) holds a value not allowed."""

    def __init__(self, variable: str, value: str, allowed: str) -> None:
        self.variable = variable
        self.value = value
        self.allowed = allowed
        super().__init__(f"{variable}={value!r} is not valid: expected {allowed}.")


@dataclass(frozen=True)
class OptionSpec:
    """One serving option: its field, CLI flag, variable, default as written, and meaning."""

    field: str
    flag: str
    variable: str
    default: str
    help: str


#: Every serving option, in the order the CLI and the README list them.
OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec(
        "path",
        "--path",
        "ATTNQUANT_PATH",
        "auto",
        "Execution path. auto: a dense or passthrough checkpoint on the stock graph "
        "(precompute-outside), a compressed theta checkpoint of a Llama model in the graph "
        "(in-graph); precompute-outside: W_eff = s*W0 + U V^T rebuilt once at load, stock MAX "
        "graph; in-graph: GEMM or custom op, the one measured faster on the device; gemm: "
        "s*(x W0^T) + (x V) U^T; custom-op: attnquant-kernels' generated_linear/mlp/lowrank "
        "(a dense checkpoint too, decomposed at load at passthrough: on a CPU it can decode "
        "faster than the stock matmul, see docs/serving-paths.md); "
        "precompute: W_eff formed in the graph each forward.",
    ),
    OptionSpec(
        "blocks",
        "--blocks",
        "ATTNQUANT_BLOCKS",
        "unset",
        "Shared blocks G: a theta checkpoint's must match it; a dense checkpoint is "
        "decomposed at load at this G ('layers': passthrough, the default for a dense one).",
    ),
    OptionSpec(
        "rank",
        "--rank",
        "ATTNQUANT_RANK",
        "16",
        "Rank r of the correction when a dense checkpoint is decomposed at load.",
    ),
    OptionSpec(
        "quant",
        "--quant",
        "ATTNQUANT_QUANT",
        "unset",
        "nvfp4: every W_eff quantized to NVFP4 at load (4.5 bits a weight), precompute-outside "
        "only; a checkpoint whose W0 is already NVFP4 is served as stored.",
    ),
    OptionSpec(
        "quant_head",
        "--quant-head/--no-quant-head",
        "ATTNQUANT_QUANT_HEAD",
        "0",
        "The output head in NVFP4 too, beside NVFP4 projections or on an in-graph path.",
    ),
    OptionSpec(
        "quant_embedding",
        "--quant-embedding/--no-quant-embedding",
        "ATTNQUANT_QUANT_EMBEDDING",
        "0",
        "With --quant-head: the embedding table in NVFP4 too, its rows gathered packed and "
        "decoded in the graph; a tied model holds one 4-bit table for both.",
    ),
    OptionSpec(
        "nvfp4_kernel",
        "--nvfp4-kernel",
        "ATTNQUANT_NVFP4_KERNEL",
        "auto",
        "How NVFP4 projections run: fused (one generated_linear_nvfp4 dispatch), dequantize "
        "(dequantized in the graph, then a matmul), auto (the faster, timed at start-up).",
    ),
    OptionSpec(
        "nvfp4_tiled",
        "--nvfp4-tiled/--no-nvfp4-tiled",
        "ATTNQUANT_NVFP4_TILED",
        "1",
        "Fused NVFP4: packed weights rewritten at load in the tiled layout where the CPU has "
        "AVX-512 (same bytes); off keeps them row-major.",
    ),
    OptionSpec(
        "nvfp4_int8",
        "--nvfp4-int8/--no-nvfp4-int8",
        "ATTNQUANT_NVFP4_INT8",
        "1",
        "Fused NVFP4 on the tiled layout: the activations are rounded to int8 per group of 64 "
        "inputs, in decode steps, batches and prompts alike, and multiplied as integers "
        "(AVX-512 VNNI where the CPU has it; "
        "within the tolerance of docs/decode-speed.md); off keeps float activations, equal to "
        "the float projection. Where the tiled op does not serve, activations stay float.",
    ),
    OptionSpec(
        "nvfp4_merge",
        "--nvfp4-merge/--no-nvfp4-merge",
        "ATTNQUANT_NVFP4_MERGE",
        "1",
        "Fused NVFP4 in float32: q/k/v and gate/up merged at load into one dispatch each; off "
        "runs one dispatch per member.",
    ),
    OptionSpec(
        "qkv_fuse",
        "--qkv-fuse/--no-qkv-fuse",
        "ATTNQUANT_QKV_FUSE",
        "1",
        "GEMM path: q/k/v and gate/up batched into one dispatch each.",
    ),
    OptionSpec(
        "fused_mlp",
        "--fused-mlp/--no-fused-mlp",
        "ATTNQUANT_FUSED_MLP",
        "1",
        "Custom-op path: a banded MLP in one generated_mlp dispatch.",
    ),
    OptionSpec(
        "worker_nice",
        "--worker-nice",
        "ATTNQUANT_WORKER_NICE",
        str(DEFAULT_WORKER_NICE),
        "On a CPU: the nice value (0-19) MAX's runtime workers get at load, so the Python "
        "thread that drives each step wins a core from the workers spinning after a graph; "
        "0 leaves them as MAX starts them. A higher value cedes more CPU to other processes "
        "on a shared machine (docs/decode-speed.md).",
    ),
)


def options_table() -> str:
    """:data:`OPTIONS` as a Markdown table (the README's options table)."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for spec in OPTIONS:
        rows.append(f"| `{spec.flag}` | `{spec.variable}` | {spec.default} | {spec.help} |")
    legacy = (
        "| | `ATTNQUANT_PRECOMPUTE_OUTSIDE`, `ATTNQUANT_PRECOMPUTE`, `ATTNQUANT_GEMM` | unset | "
        "read for compatibility when `ATTNQUANT_PATH` is unset: `PRECOMPUTE=1` precompute, "
        "`PRECOMPUTE_OUTSIDE=1` precompute-outside, `PRECOMPUTE_OUTSIDE=0` in-graph, `GEMM=1` "
        "gemm, `GEMM=0` custom-op |"
    )
    return "\n".join([*rows, legacy])


def _get(env: Mapping[str, str], name: str) -> str | None:
    """The stripped value of ``name``; an empty string counts as unset."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    return raw.strip()


def _bool(name: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ConfigError(name, raw, _BOOL_ALLOWED)


def _whole_number(
    name: str, raw: str, *, minimum: int, allowed: str, maximum: int | None = None
) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, raw, allowed) from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(name, raw, allowed)
    return value


_BOOLS = (
    "quant_head",
    "quant_embedding",
    "nvfp4_tiled",
    "nvfp4_int8",
    "nvfp4_merge",
    "qkv_fuse",
    "fused_mlp",
)
_NICE_ALLOWED = f"a whole number from 0 to {MAX_NICE}"
_BLOCKS_ALLOWED = "a whole number >= 1, or 'layers' for passthrough (one block per layer)"


def parse_blocks(name: str, raw: str) -> int | Literal["layers"]:
    """``--blocks`` / ``ATTNQUANT_BLOCKS``: a whole number >= 1 or ``layers``."""
    if raw.strip().lower() == "layers":
        return "layers"
    return _whole_number(name, raw.strip(), minimum=1, allowed=_BLOCKS_ALLOWED)


def _choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    if raw.lower() in choices:
        return raw.lower()
    raise ConfigError(name, raw, "one of " + ", ".join(choices))


def _legacy_path(env: Mapping[str, str]) -> str:
    """The path the variables before ``ATTNQUANT_PATH`` ask for (``auto`` when none is set)."""
    precompute = _get(env, "ATTNQUANT_PRECOMPUTE")
    if precompute is not None and _bool("ATTNQUANT_PRECOMPUTE", precompute):
        return "precompute"
    outside = _get(env, "ATTNQUANT_PRECOMPUTE_OUTSIDE")
    gemm = _get(env, "ATTNQUANT_GEMM")
    formulation = (
        None if gemm is None else ("gemm" if _bool("ATTNQUANT_GEMM", gemm) else "custom-op")
    )
    if outside is not None and _bool("ATTNQUANT_PRECOMPUTE_OUTSIDE", outside):
        return "precompute-outside"
    if outside is not None:
        return formulation or "in-graph"
    return formulation or "auto"


@dataclass(frozen=True, kw_only=True)
class ServingOptions:
    """How attnquant serves a checkpoint through MAX (each field one entry of :data:`OPTIONS`).

    Attributes
    ----------
    path : str
        ``auto`` (follow the checkpoint), ``precompute-outside``, ``in-graph`` (GEMM or custom
        op, as measured faster on the device), ``gemm``, ``custom-op`` or ``precompute``.
    blocks : int, "layers" or None
        ``G``; ``None`` takes a theta checkpoint's own, passthrough for a dense one.
    rank : int
        ``r`` when a dense checkpoint is decomposed at load.
    quant : "nvfp4" or None
        Quantize each ``W_eff`` at load.
    quant_head : bool
        The output head in NVFP4 too (a tied head quantized from the embedding table).
    quant_embedding : bool
        With ``quant_head``: the embedding table in NVFP4 too (a tied model's is the head's).
    nvfp4_kernel : "auto", "fused" or "dequantize"
        How NVFP4 projections run.
    nvfp4_tiled, nvfp4_merge : bool
        Fused NVFP4: the tiled layout where the CPU has it; q/k/v and gate/up merged.
    nvfp4_int8 : bool
        Fused NVFP4 on the tiled layout: int8 activations at every row count (elsewhere: no
        effect).
    qkv_fuse, fused_mlp : bool
        GEMM path: q/k/v and gate/up batched; custom op: the MLP in one dispatch.
    worker_nice : int
        On a CPU, the nice value (0-19) of MAX's runtime workers; 0 leaves them as started.
    """

    path: PathChoice = "auto"
    blocks: int | Literal["layers"] | None = None
    rank: int = 16
    quant: Quant | None = None
    quant_head: bool = False
    quant_embedding: bool = False
    nvfp4_kernel: NVFP4Kernel = "auto"
    nvfp4_tiled: bool = True
    nvfp4_int8: bool = True
    nvfp4_merge: bool = True
    qkv_fuse: bool = True
    fused_mlp: bool = True
    worker_nice: int = DEFAULT_WORKER_NICE

    def __post_init__(self) -> None:
        if self.path not in PATH_CHOICES:
            raise ConfigError("--path", str(self.path), "one of " + ", ".join(PATH_CHOICES))
        blocks = self.blocks
        bad_int = isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1
        if blocks is not None and blocks != "layers" and bad_int:
            raise ConfigError("--blocks", str(blocks), _BLOCKS_ALLOWED)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError("--rank", str(self.rank), "a whole number >= 0")
        if self.quant not in (None, "nvfp4"):
            raise ConfigError("--quant", str(self.quant), "'nvfp4' or unset (no quantization)")
        if self.nvfp4_kernel not in NVFP4_KERNELS:
            raise ConfigError(
                "--nvfp4-kernel", str(self.nvfp4_kernel), "one of " + ", ".join(NVFP4_KERNELS)
            )
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"--{name.replace('_', '-')}", str(getattr(self, name)), "bool")
        nice = self.worker_nice
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= MAX_NICE:
            raise ConfigError("--worker-nice", str(nice), _NICE_ALLOWED)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServingOptions:
        """Parse the ``ATTNQUANT_*`` variables of ``env`` (``os.environ`` by default).

        ``ATTNQUANT_PATH`` names the path; when it is unset the older variables
        (:data:`LEGACY_PATH_VARIABLES`) are read as before: setting both is refused.

        Raises
        ------
        ConfigError
            A variable holds a value that is not allowed, naming it, the value and what is.
        """
        env = os.environ if env is None else env
        given: dict[str, Any] = {}
        raw_path = _get(env, "ATTNQUANT_PATH")
        legacy = [name for name in LEGACY_PATH_VARIABLES if _get(env, name) is not None]
        if raw_path is not None:
            if legacy:
                raise ConfigError(
                    legacy[0], str(_get(env, legacy[0])), "unset when ATTNQUANT_PATH is set"
                )
            given["path"] = _choice("ATTNQUANT_PATH", raw_path, PATH_CHOICES)
        else:
            given["path"] = _legacy_path(env)
        if (raw := _get(env, "ATTNQUANT_BLOCKS")) is not None:
            given["blocks"] = parse_blocks("ATTNQUANT_BLOCKS", raw)
        if (raw := _get(env, "ATTNQUANT_RANK")) is not None:
            given["rank"] = _whole_number(
                "ATTNQUANT_RANK", raw, minimum=0, allowed="a whole number >= 0"
            )
        if (raw := _get(env, "ATTNQUANT_QUANT")) is not None:
            if raw.lower() != "nvfp4":
                raise ConfigError("ATTNQUANT_QUANT", raw, "'nvfp4' or unset (no quantization)")
            given["quant"] = "nvfp4"
        if (raw := _get(env, "ATTNQUANT_NVFP4_KERNEL")) is not None:
            given["nvfp4_kernel"] = _choice("ATTNQUANT_NVFP4_KERNEL", raw, NVFP4_KERNELS)
        for name in _BOOLS:
            variable = f"ATTNQUANT_{name.upper()}"
            if (raw := _get(env, variable)) is not None:
                given[name] = _bool(variable, raw)
        if (raw := _get(env, "ATTNQUANT_WORKER_NICE")) is not None:
            given["worker_nice"] = _whole_number(
                "ATTNQUANT_WORKER_NICE", raw, minimum=0, maximum=MAX_NICE, allowed=_NICE_ALLOWED
            )
        return cls(**given)

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> ServingOptions:
        """The options a command runs with: each flag given (not ``None``) over ``env``'s
        variables (``os.environ``) over the defaults."""
        base = cls.from_env(env)
        given = {k: v for k, v in (flags or {}).items() if v is not None}
        unknown = set(given) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown serving options {sorted(unknown)}")
        return replace(base, **given)

    def to_env(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """``env`` (``os.environ``) with these options as canonical ``ATTNQUANT_*`` variables,
        the older path variables removed: what a ``max serve`` child reads back exactly."""
        out = dict(os.environ if env is None else env)
        for name in LEGACY_PATH_VARIABLES:
            out.pop(name, None)
        for spec in OPTIONS:
            value = getattr(self, spec.field)
            if value is None:
                out.pop(spec.variable, None)
            elif isinstance(value, bool):
                out[spec.variable] = "1" if value else "0"
            else:
                out[spec.variable] = str(value)
        return out

    @property
    def in_graph_asked(self) -> bool:
        """Whether the options name an in-graph path (any but ``auto`` and precompute-outside)."""
        return self.path not in ("auto", "precompute-outside")
