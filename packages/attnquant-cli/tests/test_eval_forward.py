"""``attnquant eval --forward``: which forward runs, and why, without attnquant-max.

This session has no attnquant-max (the ``serve`` extra); where it is installed, the choices
that ask MAX itself are tested in the root ``tests/test_eval_forward_max.py``.
"""

from __future__ import annotations

import pytest
import typer

from attnquant_cli import demo_model_path
from attnquant_cli._eval import choose_forward


def test_numpy_and_float64_never_ask_for_max():
    chosen, why = choose_forward("auto", [demo_model_path()], devices="cpu", float64=True)
    assert chosen == "numpy" and "float64" in why
    assert choose_forward("numpy", [demo_model_path()], devices="cpu", float64=False)[0] == "numpy"


@pytest.mark.parametrize(
    ("forward", "float64", "error", "message"),
    [
        ("max", True, ValueError, "MAX computes in float32"),
        ("gpu", False, typer.BadParameter, "choose auto, max"),
    ],
)
def test_bad_forward_choices_are_refused(forward, float64, error, message):
    with pytest.raises(error, match=message):
        choose_forward(forward, [demo_model_path()], devices="cpu", float64=float64)
