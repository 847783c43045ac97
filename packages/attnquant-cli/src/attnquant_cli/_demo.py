"""The embedded demo model: a tiny Llama trained by this project (see demo_model/MODEL_CARD.md)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["demo_model_path"]


def demo_model_path() -> Path:
    """The directory of the demo checkpoint shipped inside this package."""
    path = Path(__file__).with_name("demo_model")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}: the embedded demo model is missing; reinstall attnquant-cli"
        )
    return path
