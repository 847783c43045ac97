"""The embedded demo model ships whole: a small GQA Llama with its tokenizer and model card."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from attnquant_cli import demo_model_path
from attnquant_core import open_checkpoint


@pytest.fixture(scope="module")
def demo():
    return demo_model_path()


def test_config_is_a_small_gqa_llama(demo):
    config = json.loads((demo / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] >= 4
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["torch_dtype"] == "float32"


def test_checkpoint_size_and_families(demo):
    size = sum(p.stat().st_size for p in demo.glob("*.safetensors"))
    assert size <= 16 * 2**20
    ckpt = open_checkpoint(demo)
    assert len(ckpt.families) == 7
    assert ckpt.num_layers == json.loads((demo / "config.json").read_text())["num_hidden_layers"]


def test_tokenizer_round_trips_python(demo):
    tok = Tokenizer.from_file(str(demo / "tokenizer.json"))
    text = "def main(argv=None):\n    return 0\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    config = json.loads((demo / "tokenizer_config.json").read_text())
    assert "chat_template" in config


def test_model_card_records_the_training(demo):
    card = (demo / "MODEL_CARD.md").read_text()
    for word in ("loss", "corpus", "layers"):
        assert word in card.lower()
