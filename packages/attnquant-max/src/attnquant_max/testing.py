"""The tiny Llama of attnquant's MAX tests: one fixed shape, so one compile per execution path.

Not imported by the library itself. attnquant-max's tests and the repository's integration tests
(``attnquant verify`` on the tiny model) use the same shape, weights and serving sizes, so MAX's
cache (``~/.cache/modular``, keyed by the graph, not the weights' values) compiles each graph
once for the whole CI run: change nothing here without need, every change costs a cold compile
of every path (minutes each on two cores).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from attnquant_core.testing import write_byte_tokenizer

__all__ = [
    "FAKE_MAX_SERVE",
    "FAMILY_CONFIGS",
    "HEADS",
    "HEAD_DIM",
    "HIDDEN",
    "fake_max_serve",
    "INTERMEDIATE",
    "KV_HEADS",
    "LAYERS",
    "MAX_BATCH_SIZE",
    "MAX_LENGTH",
    "PROJECTIONS",
    "TINY_RANK",
    "TINY_SERVING",
    "VOCAB",
    "gemm_weight_bytes",
    "graph_lock",
    "load_tiny",
    "tiny_llama_tensors",
    "write_tiny_bundle",
    "write_tiny_family",
    "write_tiny_llama",
    "write_tokenizer",
]

# The one model shape of the test suites.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 64, 2, 4, 2, 16, 128, 272
# The one serving size: part of every compiled graph.
MAX_LENGTH, MAX_BATCH_SIZE = 64, 4
TINY_SERVING: dict[str, int] = {"max_length": MAX_LENGTH, "max_batch_size": MAX_BATCH_SIZE}
# The rank of the bundle every in-graph path serves as a whole model (write_tiny_bundle); the
# k/v shapes [32, 64] allow up to 32.
TINY_RANK = 16
SPECIALS = ["<s>", "</s>"] + [f"<extra_{i}>" for i in range(VOCAB - 258)]

PROJECTIONS = {
    "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}


def tiny_llama_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights of the tiny Llama (Hugging Face keys), fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    tensors = {
        "model.embed_tokens.weight": rng.normal(0.0, 1.0, (VOCAB, HIDDEN)),
        "model.norm.weight": np.ones(HIDDEN),
        "lm_head.weight": rng.normal(0.0, 0.3, (VOCAB, HIDDEN)),
    }
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        tensors[prefix + "input_layernorm.weight"] = np.ones(HIDDEN)
        tensors[prefix + "post_attention_layernorm.weight"] = np.ones(HIDDEN)
        for family, shape in PROJECTIONS.items():
            tensors[prefix + family + ".weight"] = rng.normal(0.0, shape[1] ** -0.5, shape)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE with no merges (one token per byte), padded with specials to VOCAB."""
    write_byte_tokenizer(
        directory, SPECIALS, bos_token="<s>", eos_token="</s>", model_max_length=MAX_LENGTH
    )


def write_tiny_llama(
    directory: Path, tensors: dict[str, np.ndarray] | None = None, **config_fields: Any
) -> Path:
    """Write the tiny Llama (``config.json``, weights, tokenizer) to ``directory``;
    ``config_fields`` override fields of its ``config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = tiny_llama_tensors() if tensors is None else tensors
    safetensors.numpy.save_file(tensors, directory / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
        **config_fields,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(directory)
    return directory


#: The text families served on the tiny Llama's shape besides Llama: what each adds to it.
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "MistralForCausalLM": {"model_type": "mistral", "sliding_window": None},
    "Qwen2ForCausalLM": {
        "model_type": "qwen2",
        "attention_bias": True,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    "Qwen3ForCausalLM": {
        "model_type": "qwen3",
        "use_sliding_window": False,
        "sliding_window": None,
    },
}


def write_tiny_family(directory: Path, architecture: str, seed: int = 0) -> Path:
    """The tiny Llama as another text family (:data:`FAMILY_CONFIGS`): Mistral as it is, Qwen2
    with q/k/v biases, Qwen3 with per-head q/k RMSNorms (weights near 1, not 1, so a norm left
    out or misplaced shows)."""
    tensors = tiny_llama_tensors(seed)
    rng = np.random.default_rng(seed + 100)
    for i in range(LAYERS):
        prefix = f"model.layers.{i}.self_attn."
        if architecture == "Qwen2ForCausalLM":
            for p in "qkv":
                rows = tensors[f"{prefix}{p}_proj.weight"].shape[0]
                tensors[f"{prefix}{p}_proj.bias"] = rng.normal(0.0, 0.2, rows).astype(np.float32)
        if architecture == "Qwen3ForCausalLM":
            for p in "qk":
                norm = 1.0 + rng.normal(0.0, 0.2, HEAD_DIM)
                tensors[f"{prefix}{p}_norm.weight"] = norm.astype(np.float32)
    return write_tiny_llama(
        directory, tensors, architectures=[architecture], **FAMILY_CONFIGS[architecture]
    )


@contextmanager
def graph_lock(name: str) -> Iterator[None]:
    """Under pytest-xdist, one worker at a time inside (per ``name``, per test run): a worker
    that needs a graph another one is compiling waits, then reads it from MAX's cache instead
    of compiling it too. Without xdist there is no one to wait for."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    folder = Path(tempfile.gettempdir()) / f"attnquant-graphs-{run}"
    folder.mkdir(exist_ok=True)
    safe = "".join(c if c.isalnum() else "-" for c in name)[:200]
    with open(folder / f"{safe}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_tiny(path: Path, options: Any = None) -> Any:
    """``load_pipeline`` of a tiny checkpoint at the suites' one serving size, offline, with
    ``options`` (default: the stock graph, ``--path precompute-outside``)."""
    from ._generate import STOCK, load_pipeline

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    return load_pipeline(path, **TINY_SERVING, options=STOCK if options is None else options)


def write_tiny_bundle(dense: Path, out: Path, *, rank: int = TINY_RANK, seed: int = 1) -> Path:
    """The bundle the in-graph paths serve as a whole model: one ``W0`` per layer, as at
    passthrough (the production shape, and the cheapest graph to compile: every layer's theta
    ops are alike), but with every term of the identity at work: ``W0`` is the dense weight,
    ``s`` is ``1 +- 0.1`` and ``U Vᵀ`` a rank-``rank`` term about 0.3 of the weight's scale.

    It is a different model from ``dense`` (``W_eff = s·W0 + U Vᵀ``), made to compare execution
    paths on one bundle; bands shared by several layers are checked at the layer level.
    """
    from attnquant_core import FamilyTheta, LayerTheta, ThetaModel, open_checkpoint, save_theta

    rng = np.random.default_rng(seed)
    ckpt = open_checkpoint(dense)
    tensors = {key: ckpt.get(key) for key in ckpt.keys()}
    families = {}
    for name, info in ckpt.families.items():
        out_dim, in_dim = info.shape
        weights = tuple(np.ascontiguousarray(tensors.pop(key)) for key in info.keys)
        layers = tuple(
            LayerTheta(
                s=(1.0 + rng.normal(0.0, 0.1, out_dim)).astype(np.float32),
                U=rng.normal(0.0, 0.3 * in_dim**-0.5, (out_dim, rank)).astype(np.float32),
                V=rng.normal(0.0, rank**-0.5, (in_dim, rank)).astype(np.float32),
            )
            for _ in weights
        )
        families[name] = FamilyTheta(
            name=name, shared=weights, bands=tuple(range(len(weights))), layers=layers
        )
    config = json.loads((dense / "config.json").read_text())
    model = ThetaModel(families=families, stack=ckpt.stack, extra=tensors)
    save_theta(model, out, config=config, source_dir=dense)
    return out


def gemm_weight_bytes(theta: Path) -> int:
    """The bytes a theta checkpoint's model holds on the GEMM path: every tensor the checkpoint
    stores, except that a layer served dense (:func:`attnquant_core.serving.served_layers`: its
    factors are not smaller) holds its dense weight instead of its factors. A shared-basis band
    of width 0 (held as one zero column) is not counted; the checkpoints of the tests have none.
    """
    from attnquant_core import ThetaCheckpoint
    from attnquant_core.serving import served_layers

    ckpt = ThetaCheckpoint.open(theta)
    total = sum(
        a.nbytes
        for f in theta.glob("*.safetensors")
        for a in safetensors.numpy.load_file(f).values()
    )
    for name in ckpt.families:
        fam = ckpt.family_theta(name)
        how = served_layers(fam)
        out_dim, in_dim = fam.shape
        itemsize = np.dtype(fam.dtype).itemsize
        dense = [i for i, h in enumerate(how) if h.kind == "dense"]
        total += len(dense) * out_dim * in_dim * itemsize
        if fam.form == "lowrank":
            total -= sum(fam.U[i].nbytes + fam.V[i].nbytes for i in dense)
        elif fam.form == "shared_basis" and dense:  # all layers or none
            total -= sum(a.nbytes for a in fam.arrays())
    return total


#: A stand-in for ``max serve`` to supervise: answers ``GET /health`` with 200 on the port it is
#: given and exits with code 3 after LIFE seconds (never when LIFE is 0).
FAKE_MAX_SERVE = """
import http.server, os, sys, threading
port, life = int(sys.argv[1]), float(sys.argv[2])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
if life:
    threading.Timer(life, lambda: os._exit(3)).start()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def fake_max_serve(life: float):
    """``argv_for(port)`` of :data:`FAKE_MAX_SERVE`, for :class:`attnquant_max.gateway.Backend`."""
    import sys

    return lambda port: [sys.executable, "-c", FAKE_MAX_SERVE, str(port), str(life)]
