"""What alignment acts on: the supported architectures, the layout of one decoder layer's tensors
(heads, rotary planes, MLP channels) read from the config, and its weights as per-unit blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._errors import AttnquantError, CheckpointError
from ..io._checkpoint import detect_families
from ..io._safetensors import TensorSpec

__all__ = ["ALIGN_MANIFEST_FILE", "ALIGN_TRANSFORMS_FILE", "AlignError"]


ALIGN_FORMAT = "attnquant-align"


ALIGN_VERSION = 1


ALIGN_TRANSFORMS_FILE = "attnquant-align.npz"


ALIGN_MANIFEST_FILE = "attnquant-align.json"


#: Decoders whose layers are Llama-shaped with ``rotate_half`` rotary embeddings over the whole
#: head: the symmetries above are exact for them.
ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
    }
)


MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text"}
)


#: Why Gemma 4 is not aligned (one line): its symmetries differ from those above.
GEMMA4_WHY = (
    "alignment does not support Gemma 4: its global layers have their own head size and, with "
    "attention_k_eq_v, take their values from k_proj (before k_norm and RoPE), so the value "
    "rotations alignment applies would change the keys; decompose it without --align"
)


ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# Block names: every block is [n, d, X] (attention) or [I, X] (MLP) and transforms act on
# axis 0 (permutations) and on the left of axis 1 (rotations).
_ATTN_PARTS = {
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
}


_MLP_PARTS = {
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias",
    "up_bias": "mlp.up_proj.bias",
}


_FAMILY_OF = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


# Per-layer tensors alignment leaves alone and whose meaning it knows: hidden-size norms, biases
# of outputs in the residual stream, the per-head-dim q/k norms (handled), rotary buffers.
_PASSIVE = frozenset(
    {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "self_attn.o_proj.bias",
        "mlp.down_proj.bias",
        "self_attn.rotary_emb.inv_freq",
    }
)


class AlignError(AttnquantError, ValueError):
    """A model alignment cannot handle (architecture, shapes, unknown per-layer tensors)."""


@dataclass(frozen=True)
class _Layout:
    """What alignment needs to know about a model, checked against its tensors."""

    stack: str
    num_layers: int
    num_heads: int | None  # None: no attention families to align
    num_kv_heads: int | None
    head_dim: int | None
    intermediate: int | None  # None: no MLP families
    dtypes: dict[str, np.dtype]  # family -> stored dtype

    @property
    def n_rep(self) -> int:
        assert self.num_heads and self.num_kv_heads
        return self.num_heads // self.num_kv_heads

    def key(self, layer: int, suffix: str) -> str:
        return f"{self.stack}.{layer}.{suffix}"


class _SpecView:
    """The two methods of :class:`SafetensorsFiles` that family detection uses, over specs."""

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        self._specs = specs

    def keys(self) -> list[str]:
        return sorted(self._specs)

    def spec(self, key: str) -> TensorSpec:
        return self._specs[key]


def _text_config(config: Mapping | None, where: str) -> dict:
    if not isinstance(config, Mapping):
        raise AlignError(f"{where}: no config.json; alignment needs the head counts from it")
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, Mapping) else dict(config)


def _layout(config: Mapping | None, specs: Mapping[str, TensorSpec], where: str) -> _Layout:
    cfg = _text_config(config, where)
    archs = [a for a in (config or {}).get("architectures") or [] if isinstance(a, str)]
    if any(a.startswith("Gemma4") for a in archs) or str(cfg.get("model_type")).startswith(
        "gemma4"
    ):
        raise AlignError(f"{where}: {GEMMA4_WHY}")
    if not (set(archs) & ARCHITECTURES or cfg.get("model_type") in MODEL_TYPES):
        named = ", ".join(archs) or repr(cfg.get("model_type"))
        raise AlignError(
            f"{where}: unknown architecture {named}; alignment knows {', '.join(sorted(ARCHITECTURES))}"
        )
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise AlignError(f"{where}: partial_rotary_factor != 1 is not supported by alignment")
    try:
        families = detect_families(Path(where), _SpecView(specs))  # type: ignore[arg-type]
    except CheckpointError as exc:
        raise AlignError(str(exc)) from None
    some = next(iter(families.values()))
    stack, L = some.stack, some.num_layers
    present = set(families)
    for group in (ATTN, MLP):
        if present & set(group) and not set(group) <= present:
            missing = sorted(set(group) - present)
            raise AlignError(f"{where}: family {missing[0]} is missing; alignment needs {group}")
    dtypes = {name: info.dtype for name, info in families.items()}
    for name, dt in dtypes.items():
        if np.dtype(dt).itemsize < 2:
            raise AlignError(
                f"{where}: {name} is stored in {dt}; refusing to rotate float8 weights"
            )

    def shape(name: str) -> tuple[int, int]:
        return families[name].shape

    nh = nkv = hd = inter = None
    if "self_attn.q_proj" in present:
        hidden = shape("self_attn.q_proj")[1]
        nh = cfg.get("num_attention_heads")
        if not isinstance(nh, int) or nh < 1:
            raise AlignError(f"{where}: config has no valid num_attention_heads ({nh!r})")
        nkv = cfg.get("num_key_value_heads") or nh
        hd = cfg.get("head_dim") or int(cfg.get("hidden_size") or hidden) // nh
        if not isinstance(nkv, int) or nkv < 1 or nh % nkv:
            raise AlignError(
                f"{where}: num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}"
            )
        if hd % 2:
            raise AlignError(f"{where}: head_dim={hd} is odd; rotary planes need even head_dim")
        want = {
            "self_attn.q_proj": (nh * hd, hidden),
            "self_attn.k_proj": (nkv * hd, hidden),
            "self_attn.v_proj": (nkv * hd, hidden),
            "self_attn.o_proj": (hidden, nh * hd),
        }
        for name, expected in want.items():
            if shape(name) != expected:
                raise AlignError(
                    f"{where}: {families[name].keys[0]} has shape {list(shape(name))}, but the "
                    f"config ({nh} heads, {nkv} kv heads, head_dim {hd}) gives {list(expected)}"
                )
    if "mlp.gate_proj" in present:
        inter, hidden = shape("mlp.gate_proj")
        for name, expected in (
            ("mlp.up_proj", (inter, hidden)),
            ("mlp.down_proj", (hidden, inter)),
        ):
            if shape(name) != expected:
                raise AlignError(
                    f"{where}: {families[name].keys[0]} has shape {list(shape(name))}, expected "
                    f"{list(expected)} to match mlp.gate_proj"
                )
    layout = _Layout(stack, L, nh, nkv, hd, inter, dtypes)
    _check_layer_keys(layout, specs, where)
    return layout


def _check_layer_keys(layout: _Layout, specs: Mapping[str, TensorSpec], where: str) -> None:
    """Refuse per-layer tensors whose meaning alignment does not know; check bias/norm shapes."""
    handled = set(_ATTN_PARTS.values()) | set(_MLP_PARTS.values())
    prefix = layout.stack + "."
    for key in specs:
        if not key.startswith(prefix):
            continue
        suffix = key[len(prefix) :].partition(".")[2]
        if suffix not in handled and suffix not in _PASSIVE:
            raise AlignError(
                f"{where}: {key} is a per-layer tensor alignment does not know; refusing, as "
                f"permuting or rotating around it might change the function"
            )
        shape = tuple(specs[key].shape)
        hd = layout.head_dim
        want: tuple[int, ...] | None = None
        if suffix in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            want = (hd,) if hd else shape
        elif suffix == "self_attn.q_proj.bias" and layout.num_heads:
            want = (layout.num_heads * (hd or 0),)
        elif suffix in ("self_attn.k_proj.bias", "self_attn.v_proj.bias") and layout.num_kv_heads:
            want = (layout.num_kv_heads * (hd or 0),)
        elif suffix in ("mlp.gate_proj.bias", "mlp.up_proj.bias") and layout.intermediate:
            want = (layout.intermediate,)
        if want is not None and shape != want:
            raise AlignError(f"{where}: {key} has shape {list(shape)}, expected {list(want)}")


def _to_blocks(part: str, W: np.ndarray, layout: _Layout) -> np.ndarray:
    """A stored weight or bias as float64 blocks: ``[n, d, X]`` for attention, ``[I, X]`` MLP."""
    W = np.asarray(W, dtype=np.float64)
    d = layout.head_dim or 0
    if part == "o":
        return W.T.reshape(-1, d, W.shape[0])
    if part in ("q", "k", "v"):
        return W.reshape(-1, d, W.shape[1])
    if part.endswith("_bias") and part[0] in "qkv":
        return W.reshape(-1, d, 1)
    if part == "down":
        return W.T
    if part.endswith("_bias"):
        return W[:, None]
    return W


def _from_blocks(part: str, B: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The inverse of :func:`_to_blocks`, rounded to the stored ``dtype``."""
    if part == "o":
        out = B.reshape(-1, B.shape[2]).T
    elif part in ("q", "k", "v"):
        out = B.reshape(-1, B.shape[2])
    elif part.endswith("_bias"):
        out = B.reshape(-1)
    elif part == "down":
        out = B.T
    else:
        out = B
    return np.ascontiguousarray(out).astype(dtype)
