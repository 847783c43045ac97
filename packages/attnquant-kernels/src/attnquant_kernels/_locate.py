"""Where the Mojo sources are, the custom-op names they register, and the rank limit."""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "KERNEL_OPS",
    "MAX_RANK",
    "RankError",
    "check_rank",
    "kernels_path",
    "mojo_sources",
]

#: Custom-op names registered by the Mojo package (``@compiler.register(name)``).
KERNEL_OPS: tuple[str, ...] = (
    "generated_linear",
    "generated_mlp",
    "generated_linear_nvfp4",
    "nvfp4_dequantize",
    "generated_lowrank",
    "generated_linear_nvfp4_tiled",
    "generated_linear_nvfp4_tiled_a8",
)

#: Largest correction rank ``r`` the custom ops accept (the Mojo side refuses above it too).
MAX_RANK = 64


class RankError(ValueError):
    """A correction rank above :data:`MAX_RANK`: only the GEMM formulation serves it."""

    def __init__(self, rank: int, op: str = "generated_linear", what: str = "") -> None:
        self.rank = rank
        self.op = op
        label = f"{what} rank" if what else "rank"
        super().__init__(
            f"{op}: {label} r={rank} is above {MAX_RANK}, the largest rank the custom op "
            f"supports; use the GEMM formulation (ATTNQUANT_GEMM=1)"
        )


def check_rank(rank: int, *, op: str = "generated_linear", what: str = "") -> int:
    """Return ``rank`` when the custom op ``op`` can serve it.

    Raises
    ------
    RankError
        ``rank > MAX_RANK``; the message names the GEMM path (``ATTNQUANT_GEMM=1``).
    ValueError
        ``rank`` is negative or not an int.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{op}: rank must be a whole number >= 0, got {rank!r}")
    if rank > MAX_RANK:
        raise RankError(rank, op, what)
    return rank


def kernels_path() -> Path:
    """The Mojo package folder to pass as ``custom_extensions=[kernels_path()]``."""
    path = Path(__file__).with_name("mojo")
    if not (path / "__init__.mojo").is_file():
        raise FileNotFoundError(
            f"{path}: the Mojo kernel package is incomplete (no __init__.mojo); "
            f"reinstall attnquant-kernels"
        )
    return path


def mojo_sources() -> list[Path]:
    """Every ``.mojo`` file of the package, sorted."""
    return sorted(kernels_path().glob("*.mojo"))
