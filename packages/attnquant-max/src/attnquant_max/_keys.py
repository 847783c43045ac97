"""Key checks between a checkpoint, the state handed to MAX and what its model reads.

The stock MAX loaders zero-fill a weight they do not find, without a word, so these checks are
what stands between a broken checkpoint and a server that produces text from zeros: every
weight the model needs is present, no theta key is left where the stock model would ignore it,
and a theta checkpoint rebuilds exactly its source's keys.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from attnquant_core import FAMILIES, MANIFEST_FILE, CheckpointError

__all__ = [
    "WeightKeyError",
    "check_source_keys",
    "check_state_keys",
    "expected_layer_type_keys",
    "expected_llama_keys",
    "expected_uniform_keys",
    "is_attnquant_key",
    "listed",
    "source_keys",
]

#: How many offending keys an error message lists before it says "and N more".
_MAX_LISTED = 24


class WeightKeyError(CheckpointError):
    """The state handed to MAX lacks a weight the model needs, or carries theta keys."""


def is_attnquant_key(key: str) -> bool:
    return ".theta_" in key or key.startswith("attnquant.") or ".attnquant." in key


def listed(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - _MAX_LISTED} more" if len(keys) > _MAX_LISTED else ""
    return ", ".join(keys[:_MAX_LISTED]) + more


def expected_llama_keys(hf_config: Any) -> set[str]:
    """Every weight the stock MAX Llama3 model reads, in MAX names (``model.`` stripped)."""
    L = int(hf_config.num_hidden_layers)
    keys = {"embed_tokens.weight", "norm.weight"}
    if not getattr(hf_config, "tie_word_embeddings", False):
        keys.add("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    per_layer += [f"{family}.weight" for family in FAMILIES]
    if getattr(hf_config, "attention_bias", False):
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if getattr(hf_config, "mlp_bias", False):
        per_layer += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    keys.update(f"layers.{i}.{suffix}" for i in range(L) for suffix in per_layer)
    return keys


_LAYER = re.compile(r"^(?P<stack>(?:.*\.)?layers)\.(?P<layer>\d+)\.(?P<rest>.+)$")


def expected_uniform_keys(keys: Iterable[str], num_layers: int) -> set[str]:
    """Keys a stack of identical decoder layers needs, inferred from ``keys``.

    Every per-layer weight seen in any layer (and every projection family) is
    expected in every layer ``0 .. num_layers-1``: a weight missing from one
    layer is caught; the global keys are taken as they are.
    """
    keys = list(keys)
    suffixes: dict[str, set[str]] = {}
    out: set[str] = set()
    for key in keys:
        m = _LAYER.match(key)
        if m is None or is_attnquant_key(key):
            continue
        suffixes.setdefault(m["stack"], set()).add(m["rest"])
    for stack, rests in suffixes.items():
        rests |= {f"{family}.weight" for family in FAMILIES}
        out.update(f"{stack}.{i}.{rest}" for i in range(num_layers) for rest in rests)
    return out


def expected_layer_type_keys(
    keys: Iterable[str], num_layers: int, layer_types: Sequence[str] | None = None
) -> set[str]:
    """Keys a decoder stack needs when layers of one type are alike, inferred from ``keys``.

    Gemma 4's global layers differ from its sliding ones (another head size, no ``v_proj``
    when ``attention_k_eq_v``), so the layers are grouped by ``layer_types`` (the text
    config's; one group when ``None``) and every weight seen in a layer of a group is expected
    in every layer of that group, ``0 .. num_layers-1``. Global keys are taken as they are.
    """
    if layer_types is not None and len(layer_types) != num_layers:
        layer_types = None
    kind = (lambda i: layer_types[i]) if layer_types is not None else (lambda i: "")
    suffixes: dict[tuple[str, str], set[str]] = {}
    for key in keys:
        m = _LAYER.match(key)
        if m is None or is_attnquant_key(key) or int(m["layer"]) >= num_layers:
            continue
        suffixes.setdefault((m["stack"], kind(int(m["layer"]))), set()).add(m["rest"])
    stacks = {stack for stack, _ in suffixes}
    return {
        f"{stack}.{i}.{rest}"
        for stack in stacks
        for i in range(num_layers)
        for rest in suffixes.get((stack, kind(i)), ())
    }


def source_keys(model_path: str | Path) -> set[str] | None:
    """The dense keys of the checkpoint a theta checkpoint was decomposed from, as its
    ``attnquant.json`` records them (``source.digests``); ``None`` when not recorded."""
    try:
        manifest = json.loads((Path(model_path) / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    digests = (manifest.get("source") or {}).get("digests")
    return set(digests) if isinstance(digests, dict) and digests else None


def check_source_keys(state: Mapping[str, Any], model_path: str | Path) -> None:
    """Fail unless the rebuilt ``state`` of a theta checkpoint has exactly its source's keys.

    A tensor dropped from a theta checkpoint (a norm, the embedding) would otherwise reach a
    stock loader that zero-fills it, or fail deep inside MAX; a key the source did not have
    would be ignored. Skipped when the manifest records no source.

    Raises
    ------
    WeightKeyError
        Listing every missing and every unexpected key.
    """
    expected = source_keys(model_path)
    if expected is None:
        return
    missing = expected - state.keys()
    extra = {key for key in state.keys() - expected if not is_attnquant_key(key)}
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} tensor(s) of the source checkpoint are not in this theta "
            f"checkpoint (the stock MAX loader would serve them as zeros): {listed(missing)}"
        )
    if extra:
        parts.append(f"{len(extra)} tensor(s) the source checkpoint did not have: {listed(extra)}")
    raise WeightKeyError(f"{model_path}: " + "; ".join(parts))


def check_state_keys(
    state: Mapping[str, Any],
    expected: Iterable[str],
    *,
    model_path: str | Path = "",
    theta: Iterable[str] = (),
) -> None:
    """Fail unless ``state`` has every ``expected`` and ``theta`` key and no other theta key.

    ``theta`` names the theta tensors an in-graph model reads (empty on the
    precompute-outside path, where any theta key is an error).

    Raises
    ------
    WeightKeyError
        Listing every missing weight and every leftover theta/shared key.
    """
    theta = set(theta)
    missing = (set(expected) | theta) - state.keys()
    leftover = {key for key in state if is_attnquant_key(key) and key not in theta}
    if not missing and not leftover:
        return
    where = f"{model_path}: " if model_path else ""
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} weight(s) the model needs are missing (the stock MAX loader "
            f"would serve them as zeros): {listed(missing)}"
        )
    if leftover:
        parts.append(
            f"{len(leftover)} theta key(s) are left that the stock model cannot use "
            f"(a theta checkpoint without its attnquant.json?): {listed(leftover)}"
        )
    raise WeightKeyError(where + "; ".join(parts))
