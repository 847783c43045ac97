"""The sensitivity file: what a unit of each projection's squared output error costs the model.

JSON, beside the calibration statistics it was measured with (:func:`sensitivity_path`:
``<stats>.sensitivity.json``), written by ``attnquant calibrate --sensitivity``
(:func:`attnquant_core.calib.measure_sensitivity`) and read by ``decompose --budget
--allocation sensitivity``::

    {"format": "attnquant.sensitivity/1", "probe": 0.5, "tokens": <count>,
     "windows_digest": "sha256:...", "stats_digest": "sha256:...",
     "weights": {"<weight key>": alpha, ...}, "kl": {...}, "error2": {...}}

``weights`` is what the allocation reads (finite, ``>= 0``); ``stats_digest`` ties the file
to its statistics (a file measured with other statistics is refused).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ._atomic import write_atomic
from ._calibration import CalibrationError

__all__ = [
    "PROBE_RATIO",
    "SENSITIVITY_SUFFIX",
    "Sensitivity",
    "read_sensitivity",
    "sensitivity_path",
]

#: The uniform parameter ratio whose whitened truncation probes each projection.
PROBE_RATIO = 0.5
#: What :func:`sensitivity_path` appends to a statistics file's name.
SENSITIVITY_SUFFIX = ".sensitivity.json"
_FORMAT = "attnquant.sensitivity/1"


@dataclass(frozen=True, kw_only=True)
class Sensitivity:
    """Per projection weight key: ``weights`` (``alpha``, KL nats per token per unit of squared
    output error per token), the probe's ``kl`` and squared output error per token ``error2``
    (over the statistics' tokens); ``probe`` the ratio, ``tokens`` and ``windows_digest`` the
    windows measured on, ``stats_digest`` the statistics whose whitening made the probes."""

    weights: dict[str, float]
    kl: dict[str, float] = field(default_factory=dict)
    error2: dict[str, float] = field(default_factory=dict)
    probe: float = PROBE_RATIO
    tokens: int = 0
    windows_digest: str | None = None
    stats_digest: str | None = None

    def to_json(self) -> dict:
        return {
            "format": _FORMAT,
            "definition": "alpha = KL(dense || one projection truncated at the probe ratio, "
            "whitened) per token / its squared output error per token",
            "probe": self.probe,
            "tokens": self.tokens,
            "windows_digest": self.windows_digest,
            "stats_digest": self.stats_digest,
            "weights": self.weights,
            "kl": self.kl,
            "error2": self.error2,
        }

    def record(self, path: str | Path | None = None) -> dict[str, object]:
        """What a manifest says of the sensitivities used."""
        return {
            **({} if path is None else {"path": str(path)}),
            "probe": self.probe,
            "tokens": self.tokens,
            "windows_digest": self.windows_digest,
        }

    def write(self, path: str | Path) -> Path:
        """Write the file (atomically: a failed write leaves nothing at ``path``)."""
        path = Path(path)
        text = json.dumps(self.to_json(), indent=1) + "\n"
        write_atomic(path, lambda tmp: tmp.write_text(text))
        return path


def sensitivity_path(stats_path: str | Path) -> Path:
    """Where ``attnquant calibrate --sensitivity`` puts the weights of ``stats_path``."""
    stats_path = Path(stats_path)
    return stats_path.with_name(stats_path.name + SENSITIVITY_SUFFIX)


def read_sensitivity(path: str | Path, *, stats_digest: str | None = None) -> Sensitivity:
    """Read a sensitivity file; with ``stats_digest``, refuse one made with other statistics."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CalibrationError(
            f"{path}: no sensitivities; make them with `attnquant calibrate CKPT -o STATS "
            f"--sensitivity` (or decompose with --calibration-data)"
        ) from None
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"{path}: not a sensitivity file ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
        raise CalibrationError(f"{path}: not a sensitivity file (format {_FORMAT!r})")
    weights = raw.get("weights")
    if not isinstance(weights, dict) or not all(
        isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in weights.values()
    ):
        raise CalibrationError(f"{path}: 'weights' must map weight keys to finite numbers >= 0")
    made_with = raw.get("stats_digest")
    if stats_digest is not None and made_with is not None and made_with != stats_digest:
        raise CalibrationError(
            f"{path}: measured with statistics {made_with[:19]}, not these ({stats_digest[:19]}); "
            f"measure them again with `attnquant calibrate --sensitivity`"
        )
    return Sensitivity(
        weights={k: float(v) for k, v in weights.items()},
        kl={k: float(v) for k, v in (raw.get("kl") or {}).items()},
        error2={k: float(v) for k, v in (raw.get("error2") or {}).items()},
        probe=float(raw.get("probe", PROBE_RATIO)),
        tokens=int(raw.get("tokens", 0)),
        windows_digest=raw.get("windows_digest"),
        stats_digest=made_with,
    )
