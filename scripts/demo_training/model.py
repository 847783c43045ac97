"""A plain-PyTorch LlamaForCausalLM (same math and key names as Hugging Face's), its sizes
and its config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


@dataclass
class LlamaArgs:
    """The architecture's sizes, named as in Hugging Face's LlamaConfig."""

    vocab_size: int = 2048
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


# --preset NAME: model sizes and step count (explicit options override them).
PRESETS: dict[str, dict[str, int]] = {
    "demo": {
        "hidden": 192,
        "intermediate": 512,
        "layers": 6,
        "heads": 6,
        "kv_heads": 2,
        "steps": 1200,
    },
    "coder-256x8": {
        "hidden": 256,
        "intermediate": 768,
        "layers": 8,
        "heads": 4,
        "kv_heads": 2,
        "steps": 2500,
    },
}


def model_args(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int
) -> LlamaArgs:
    """:class:`LlamaArgs` from the command line's sizes; sizes that do not fit exit."""
    if hidden % heads:
        raise SystemExit(f"--hidden {hidden} is not a multiple of --heads {heads}")
    if heads % kv_heads:
        raise SystemExit(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    if (hidden // heads) % 2:
        raise SystemExit(f"head dim {hidden // heads} must be even (RoPE)")
    return LlamaArgs(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
    )


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half: (x1, x2) -> (-x2, x1) over the last dimension's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(a: LlamaArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin tables for ``positions``, laid out for :func:`rotate_half`."""
    inv_freq = 1.0 / (
        a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.int64).float() / a.head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # HF non-interleaved (rotate_half)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, no biases."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.a = a
        h, d = a.hidden_size, a.head_dim
        self.q_proj = nn.Linear(h, a.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, a.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, a.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(a.num_attention_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.a
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, a.num_attention_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, a.num_key_value_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, a.num_key_value_heads, a.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = a.num_attention_heads // a.num_key_value_heads
        # HF repeat_kv: query head i uses kv head i // rep.
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Llama's SiLU-gated MLP."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: attention then MLP, each with a residual."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The embeddings, layers and final norm (HF's ``model.`` key prefix)."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The causal LM with an untied ``lm_head``; its state dict keys are HF's."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.args = a
        self.model = LlamaModel(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(self.args, torch.arange(ids.shape[1]))
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def greedy(self, ids: list[int], new_tokens: int, eos_id: int | None = None) -> list[int]:
        """Up to ``new_tokens`` greedy continuation ids of ``ids`` (stopping after ``eos_id``)."""
        out = list(ids)
        for _ in range(new_tokens):
            window = out[-self.args.max_position_embeddings :]
            nxt = int(self(torch.tensor([window]))[0, -1].argmax())
            out.append(nxt)
            if eos_id is not None and nxt == eos_id:
                break
        return out[len(ids) :]


def init_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Seeded normal(0, 0.02) weights, output projections scaled by depth, norms at one."""
    g = torch.Generator().manual_seed(seed)
    n_layers = model.args.num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            nn.init.ones_(p)
            continue
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std = 0.02 / math.sqrt(2 * n_layers)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def build_model(a: LlamaArgs, seed: int) -> LlamaForCausalLM:
    """A freshly initialised model of sizes ``a``, logging its parameter count and shape."""
    model = LlamaForCausalLM(a)
    init_weights(model, seed)
    print(
        f"model: {count_parameters(model)} parameters (hidden {a.hidden_size}, "
        f"MLP {a.intermediate_size}, {a.num_hidden_layers} layers, "
        f"{a.num_attention_heads}/{a.num_key_value_heads} heads of {a.head_dim}, "
        f"vocab {a.vocab_size})",
        flush=True,
    )
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of scalars in the model's parameters."""
    return sum(p.numel() for p in model.parameters())


def hf_config(a: LlamaArgs, bos: int, eos: int, pad: int) -> dict:
    """config.json of the checkpoint: a transformers LlamaConfig (float32, untied lm_head)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": a.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "transformers_version": "4.46.0",
    }
