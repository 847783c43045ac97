"""One decompose request: every option of ``attnquant decompose``, its default, checked once.

:class:`DecomposeSpec` holds the options (bands, rank, budget, forms, alignment, calibration,
``W0`` quantization and rounding) and refuses, in ``__post_init__`` and in one line, any value
or combination that cannot be done, before anything is read or written. The defaults live
here and nowhere else: :func:`~attnquant_core.decompose_checkpoint`,
:func:`~attnquant_core.decompose_budget`, :func:`~attnquant_core.calib.decompose_calibrated`
and the command line (whose ``[default: ...]`` help comes from these constants) all read them.

An option left ``None`` was not given; ``effective_*`` give the value the fit then uses. What
can only be checked against a checkpoint (``blocks`` within ``1..L``, ``rank`` within
``min(out, in)``, a quantized family's input width) is checked where the checkpoint is opened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .._errors import DecompositionError
from ..forms._banded import QUANTS
from ..forms._bands import parse_blocks
from ._allocate import check_budget
from ._gptq import ROUNDINGS, check_rounding
from ._spectra import DEFAULT_FORMS, _check_forms

if TYPE_CHECKING:
    from ..io._calibration import CalibrationStats
    from ._whitened import Calibration

__all__ = [
    "ALLOCATIONS",
    "DEFAULT_ALLOCATION",
    "DEFAULT_BLOCKS",
    "DEFAULT_QUANT_BLOCKS",
    "DEFAULT_RANK",
    "DEFAULT_ROUNDING",
    "DEFAULT_SAMPLES",
    "DEFAULT_SEQUENTIAL",
    "DEFAULT_SEQ_LEN",
    "DecomposeSpec",
    "parse_budget",
    "spec_from",
]

#: Bands ``G`` per family when neither ``blocks`` nor ``budget`` is given: one shared ``W0``.
DEFAULT_BLOCKS = 1
#: ... and with ``quant``: passthrough, each layer its own ``W0`` (a 4-bit band mean is poor).
DEFAULT_QUANT_BLOCKS = "layers"
#: Rank ``r`` of each layer's correction when neither ``rank`` nor ``budget`` is given.
DEFAULT_RANK = 16
#: How a quantized ``W0`` is rounded where statistics cover its band.
DEFAULT_ROUNDING = "gptq"
#: Calibration windows cut from ``calibration_data`` (and by ``attnquant calibrate``): what
#: SVD-LLM and Basis Sharing calibrate with (they use 256 x 2048 on 7B models; 128 x 512 holds
#: 65k tokens, enough for a gram of width 8192 to be well conditioned after damping).
DEFAULT_SAMPLES = 128
DEFAULT_SEQ_LEN = 512
#: With ``calibration_data``: fit each layer against the compressed model's own inputs.
DEFAULT_SEQUENTIAL = True
#: How a budget's ranks are split between projections: ``global`` by whitened error drop per
#: parameter (each layer's whitened spectrum scaled to its weight's energy), ``sensitivity``
#: by the KL each projection's output error costs, measured on calibration windows
#: (:mod:`attnquant_core.calib._sensitivity`). Unset, a budget fit on statistics takes
#: ``sensitivity`` where sensitivities were measured beside them and :data:`DEFAULT_ALLOCATION`
#: where not (:func:`attnquant_core.fit._budget.resolve_allocation`; docs/real-models.md).
ALLOCATIONS = ("global", "sensitivity")
DEFAULT_ALLOCATION = "global"

Spelling = Literal["python", "cli"]


def parse_budget(text: str) -> float:
    """``--budget TEXT`` as a float in (0, 1], else a one-line error naming the option."""
    try:
        value = float(text)
    except ValueError:
        raise DecompositionError(
            f"--budget {text!r} is not a number; give stored/dense parameters in (0, 1], e.g. 0.5"
        ) from None
    try:
        return check_budget(value)
    except DecompositionError:
        raise DecompositionError(
            f"--budget {text}: must be in (0, 1] (stored parameters over dense parameters of "
            f"the projections; 0.5 keeps half)"
        ) from None


@dataclass(frozen=True, kw_only=True)
class DecomposeSpec:
    """The options of one decomposition with their defaults, validated once when made.

    ``blocks``: bands ``G`` per family (an int >= 1 or ``"layers"``, passthrough; default
    :data:`DEFAULT_BLOCKS`, :data:`DEFAULT_QUANT_BLOCKS` with ``quant``). ``rank``: ``r`` of each
    layer's correction (default :data:`DEFAULT_RANK`). ``budget``: stored over dense parameters
    in (0, 1] (bytes with ``quant``); the form and ranks are then chosen, so it excludes
    ``blocks`` and ``rank``. ``forms``: the forms a budget may choose. ``align``: align each
    family first (the caller does, :func:`~attnquant_core.align_checkpoint`). ``calibration``:
    statistics to fit for the output error; ``calibration_data``: text to calibrate on in the
    same pass instead, cut into ``samples`` windows of ``seq_len`` tokens and fit sequentially
    unless ``sequential`` is false (the caller tokenises it,
    :func:`~attnquant_core.calib.decompose_calibrated`). ``quant``: each band's ``W0`` in 4 bits;
    ``rounding``: how (``"gptq"`` where statistics cover the band, or ``"nearest"``).
    ``allocation``: how a budget is split between projections (:data:`ALLOCATIONS`, default
    ``"sensitivity"`` where sensitivities were measured beside ``calibration``, else
    :data:`DEFAULT_ALLOCATION`); ``"sensitivity"`` needs ``calibration`` (with the sensitivities
    measured beside it) or calibration windows (measured in the same pass).

    ``spelling`` only says how errors name the options: ``"python"`` (``budget=``) or ``"cli"``
    (``--budget``, whose text the spec then also parses). Values are normalised: ``blocks`` to
    an int or ``"layers"``, ``budget`` to a float, ``forms`` and ``calibration_data`` to tuples.
    """

    blocks: int | str | None = None
    rank: int | None = None
    budget: float | str | None = None
    forms: Sequence[str] = DEFAULT_FORMS
    align: bool = False
    calibration: str | Path | CalibrationStats | Calibration | None = None
    calibration_data: Sequence[str | Path] | None = ()
    samples: int | None = None
    seq_len: int | None = None
    sequential: bool | None = None
    quant: str | None = None
    rounding: str = DEFAULT_ROUNDING
    allocation: str | None = None
    spelling: Spelling = field(default="python", compare=False, repr=False)

    def __post_init__(self) -> None:
        cli = self.spelling == "cli"
        if self.spelling not in ("python", "cli"):
            raise DecompositionError(f"spelling={self.spelling!r}: choose 'python' or 'cli'")
        data = tuple(Path(p) for p in self.calibration_data or ())
        self._set("calibration_data", data)
        self._check_quant(cli)
        self._check_calibration(cli, data)
        self._check_allocation(cli, data)
        if self.budget is not None:
            if self.blocks is not None or self.rank is not None:
                raise DecompositionError(
                    "--budget chooses every family's form, bands and ranks; give either "
                    "--budget or --blocks/--rank, not both"
                    if cli
                    else "budget= chooses every family's form, bands and ranks; pass either "
                    "budget= or blocks=/rank=, not both"
                )
            self._set(
                "budget", parse_budget(str(self.budget)) if cli else check_budget(self.budget)
            )
        self._set("forms", _check_forms(self.forms))
        if self.blocks is not None:
            self._set("blocks", _check_blocks(self.blocks))
        if self.rank is not None and (
            isinstance(self.rank, bool)
            or not isinstance(self.rank, int | np.integer)
            or self.rank < 0
        ):
            raise DecompositionError(f"rank must be a non-negative int, got {self.rank!r}")
        for name, least in (("samples", 1), ("seq_len", 2)):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least
            ):
                raise DecompositionError(f"{name} must be an int >= {least}, got {value!r}")

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # normalising a frozen dataclass as it is made

    def _check_quant(self, cli: bool) -> None:
        """``rounding`` and ``quant`` known; no ``quant`` with ``calibration_data`` (yet)."""
        if self.rounding not in ROUNDINGS:
            if cli:
                raise DecompositionError(
                    f"--rounding {self.rounding!r}: choose one of {', '.join(ROUNDINGS)}"
                )
            check_rounding(self.rounding)
        if self.quant is None:
            return
        if self.quant not in QUANTS:
            raise DecompositionError(
                f"--quant {self.quant!r}: choose one of {', '.join(QUANTS)}"
                if cli
                else f"quant={self.quant!r} is not a W0 quantization; choose one of "
                f"{', '.join(QUANTS)}"
            )
        if self.calibration_data:
            raise DecompositionError(
                "--quant with --calibration-data: not supported yet; run `attnquant calibrate` "
                "first and pass its statistics with --calibration"
                if cli
                else "quant= with calibration_data=: not supported yet; calibrate first and pass "
                "the statistics as calibration="
            )

    def _check_calibration(self, cli: bool, data: tuple[Path, ...]) -> None:
        """Statistics or text, not both; what applies to the text only; no alignment with them."""
        if self.calibration is not None and data:
            raise DecompositionError(
                ("--calibration STATS and --calibration-data PATH" if cli else "calibration= and "
                 "calibration_data=") + ": give one (statistics made elsewhere, or text to "
                "calibrate on in the same pass)"
            )  # fmt: skip
        if self.sequential and not data:
            raise DecompositionError(
                ("--sequential needs --calibration-data PATH..." if cli else "sequential=True "
                 "needs calibration_data=") + ": it runs the compressed model over that text "
                "(statistics alone have no inputs to run)"
            )  # fmt: skip
        if (self.samples is not None or self.seq_len is not None) and not data:
            raise DecompositionError(
                "--samples/--seq-len apply to --calibration-data only"
                if cli
                else "samples=/seq_len= apply to calibration_data= only"
            )
        if data and self.align:
            raise DecompositionError(
                ("--calibration-data with --align" if cli else "calibration_data= with align=True")
                + ": the calibration runs the original layers, not the aligned ones; drop one "
                "of them"
            )
        if self.calibration is not None and self.align:
            raise DecompositionError(
                ("--calibration with --align" if cli else "calibration= with align=True")
                + ": the statistics are of the original layers, not the aligned ones; drop one "
                "of them"
            )

    def _check_allocation(self, cli: bool, data: tuple[Path, ...]) -> None:
        """A known allocation, given with a budget; ``sensitivity`` with calibration."""
        if self.allocation is None:
            return
        flag = "--allocation" if cli else "allocation="
        if self.allocation not in ALLOCATIONS:
            raise DecompositionError(
                f"{flag} {self.allocation!r}: choose one of {', '.join(ALLOCATIONS)}"
            )
        if self.budget is None:
            raise DecompositionError(
                f"{flag} splits a budget between the projections; give "
                + ("--budget" if cli else "budget=")
            )
        # In Python, decompose_calibrated brings its own windows: decompose_budget checks.
        if cli and self.allocation == "sensitivity" and self.calibration is None and not data:
            raise DecompositionError(
                "--allocation sensitivity weighs each projection by what its error costs on "
                "calibration text: give --calibration STATS (after `attnquant calibrate "
                "--sensitivity`) or --calibration-data PATH"
            )

    @property
    def effective_allocation(self) -> str:
        """How the budget is split: ``allocation``, else :data:`DEFAULT_ALLOCATION`."""
        return DEFAULT_ALLOCATION if self.allocation is None else self.allocation

    @property
    def effective_blocks(self) -> int | str:
        """``G`` the fit uses: ``blocks``, else passthrough with ``quant``, else one band."""
        if self.blocks is not None:
            return self.blocks
        return DEFAULT_QUANT_BLOCKS if self.quant is not None else DEFAULT_BLOCKS

    @property
    def effective_rank(self) -> int:
        """``r`` the fit uses at fixed bands: ``rank``, else :data:`DEFAULT_RANK`."""
        return DEFAULT_RANK if self.rank is None else int(self.rank)

    @property
    def effective_samples(self) -> int:
        """Calibration windows cut from ``calibration_data``."""
        return DEFAULT_SAMPLES if self.samples is None else int(self.samples)

    @property
    def effective_seq_len(self) -> int:
        """Tokens per calibration window."""
        return DEFAULT_SEQ_LEN if self.seq_len is None else int(self.seq_len)

    @property
    def effective_sequential(self) -> bool:
        """Whether a fit on ``calibration_data`` is sequential."""
        return DEFAULT_SEQUENTIAL if self.sequential is None else bool(self.sequential)


def _check_blocks(blocks: object) -> int | str:
    """``blocks`` as an int >= 1 or ``"layers"``; its upper bound ``L`` is the checkpoint's."""
    blocks = parse_blocks(blocks)
    if blocks != "layers" and blocks < 1:
        raise DecompositionError(
            f"blocks={blocks} is below 1: give a number of bands >= 1, or 'layers' (passthrough)"
        )
    return blocks


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecomposeSpec)}


def spec_from(spec: DecomposeSpec | None, **options: Any) -> DecomposeSpec:
    """``spec`` as given, or one made of a core function's keyword ``options``; not both.

    Lets the decompose functions take either a :class:`DecomposeSpec` or their keyword options,
    validated the same way, and refuse a keyword option beside a spec that would be ignored.
    """
    if spec is None:
        return DecomposeSpec(**options)
    given = [name for name, value in options.items() if not _unset(value, _FIELD_DEFAULTS[name])]
    if given:
        raise DecompositionError(
            f"pass spec= or {', '.join(f'{name}=' for name in given)}, not both"
        )
    return spec


def _unset(value: object, default: object) -> bool:
    """Whether a keyword option was left at its default (``forms`` compared as a tuple)."""
    if value is default:
        return True
    if isinstance(default, tuple) and isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(value) == default
    return isinstance(value, str | int | float) and value == default
