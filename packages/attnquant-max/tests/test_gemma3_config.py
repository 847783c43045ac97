"""The Gemma 3 fields attnquant's own architecture reads from ``config.json`` (no graph built):
both transformers layouts, the linear rotary scaling of Gemma 3 4B and up, and one-line
refusals of what it does not implement."""

from __future__ import annotations

import pytest

from attnquant_core.tiny_gemma import gemma3_text_config
from attnquant_max.architectures.gemma3.graph import gemma3_fields

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _v4(**extra: object) -> dict:
    """transformers 4's layout: flat rotary fields, ``sliding_window_pattern``."""
    config = gemma3_text_config(num_hidden_layers=6, sliding_window=512)
    del config["layer_types"]
    config.pop("rope_parameters", None)
    config.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6, **extra)
    return config


def test_transformers_5_layout() -> None:
    config = gemma3_text_config(num_hidden_layers=4, sliding_window=512, head_dim=16)
    fields = gemma3_fields(config)
    assert fields["layer_types"] == ("sliding_attention", "full_attention") * 2
    assert fields["sliding_window"] == 512 and fields["rope_global_factor"] is None
    assert fields["rope_theta"] == 1e6 and fields["rope_local_theta"] == 1e4
    assert fields["query_scale"] == pytest.approx(16**-0.5)


def test_transformers_4_layout_and_linear_scaling() -> None:
    fields = gemma3_fields(_v4(rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert fields["layer_types"] == ("sliding_attention",) * 5 + ("full_attention",)
    assert fields["rope_global_factor"] == 8.0
    assert (fields["rope_theta"], fields["rope_local_theta"]) == (1e6, 1e4)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "softcapping"),
        ({"attn_logit_softcapping": 50.0}, "softcapping"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"sliding_window": None}, "no sliding_window"),
    ],
)
def test_what_is_not_implemented_is_refused(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gemma3_fields(_v4(**extra))
