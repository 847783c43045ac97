"""Global budget: the auto form against per-layer SVD with globally allocated ranks.

For the embedded demo model (a trained float32 6-layer Llama) and a synthetic model (each
family a shared part plus a layer part, both with decaying spectra), at each budget (stored
over dense parameters of the projections) this fits :func:`attnquant_core.fit_budget` and
reports the total relative Frobenius error of the auto form (predicted from singular values
and measured on the fitted tensors), the error of per-layer truncated SVD with globally
allocated ranks at the same budget, their difference, and the forms chosen.

Run: ``uv run --all-packages --group bench python benchmarks/bench_budget.py``
(or ``uv run nox -s bench``); the JSON goes to ``--out``, by default
``bench-results/bench_budget.json``. Options it does not know (those of the other benchmarks,
which ``nox -s bench`` passes to every script) are ignored with a note.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from attnquant_core import fit_budget, open_checkpoint

BUDGETS = (0.2, 0.3, 0.5, 0.7)
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "packages/attnquant-cli/src/attnquant_cli/demo_model"


def _spectral(rng: np.random.Generator, shape: tuple[int, int], k: int = 64) -> np.ndarray:
    """A random matrix whose singular values decay like 1/(1+i/8), plus a small flat floor."""
    out_dim, in_dim = shape
    k = min(k, out_dim, in_dim)
    left = rng.standard_normal((out_dim, k)) * (1.0 / (1.0 + np.arange(k) / 8.0))
    W = left @ rng.standard_normal((k, in_dim)) / np.sqrt(in_dim)
    return W + 0.01 * rng.standard_normal(shape)


def synthetic_config(num_layers: int = 8, hidden: int = 256, intermediate: int = 704) -> dict:
    """The Llama ``config.json`` the synthetic families fit: 4 query heads, 1 KV head of 64."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": hidden // 4,
        "rope_theta": 10000.0,
    }


def synthetic_families(
    num_layers: int = 8,
    hidden: int = 256,
    intermediate: int = 704,
    seed: int = 0,
    scramble: bool = False,
) -> dict[str, list[np.ndarray]]:
    """Llama-shaped families: a shared part plus a layer part, both with decaying spectra.

    ``scramble``: each layer's MLP neurons and query heads are then permuted at random, a
    function-preserving change that hides the shared part from a per-position mean (what
    ``--align`` exists to undo).
    """
    kv = hidden // 4
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    rng = np.random.default_rng(seed)
    families = {}
    for name, shape in shapes.items():
        shared = _spectral(rng, shape)
        families[name] = [
            (shared + _spectral(rng, shape)).astype(np.float32) for _ in range(num_layers)
        ]
    if scramble:
        head = hidden // 4
        for layer in range(num_layers):
            perm = rng.permutation(intermediate)
            for name in ("mlp.gate_proj", "mlp.up_proj"):
                families[name][layer] = families[name][layer][perm]
            families["mlp.down_proj"][layer] = families["mlp.down_proj"][layer][:, perm]
            heads = np.concatenate([h * head + np.arange(head) for h in rng.permutation(4)])
            families["self_attn.q_proj"][layer] = families["self_attn.q_proj"][layer][heads]
            families["self_attn.o_proj"][layer] = families["self_attn.o_proj"][layer][:, heads]
    return families


def state_of(families: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    return {
        f"model.layers.{i}.{name}.weight": W
        for name, layers in families.items()
        for i, W in enumerate(layers)
    }


def aligned(config: dict, families: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]]:
    """The families after :func:`attnquant_core.align_state` (G=1, 3 rounds)."""
    from attnquant_core import align_state

    state, _ = align_state(config, state_of(families), blocks=1)
    L = len(next(iter(families.values())))
    return {name: [state[f"model.layers.{i}.{name}.weight"] for i in range(L)] for name in families}


def demo_families() -> dict[str, list[np.ndarray]]:
    ckpt = open_checkpoint(DEMO)
    return {name: [ckpt.get(k) for k in info.keys] for name, info in ckpt.families.items()}


def demo_config() -> dict:
    return json.loads((DEMO / "config.json").read_text())


def _forms(report) -> str:
    counts: dict[str, int] = {}
    for c in report.families.values():
        counts[c.label] = counts.get(c.label, 0) + 1
    return ", ".join(f"{n}x {label}" for label, n in sorted(counts.items()))


def run(name: str, families: dict[str, list[np.ndarray]], budgets) -> list[dict]:
    rows = []
    for budget in budgets:
        t = time.perf_counter()
        _, report = fit_budget(families, budget)
        rows.append(
            {
                "model": name,
                "budget": budget,
                "stored_over_dense": report.stored / report.dense,
                "auto_error": report.error,
                "auto_error_measured": report.measured_error,
                "lowrank_global_error": report.baseline_error,
                "difference": report.error - report.baseline_error,
                "used_baseline": report.used_baseline,
                "forms": {n: c.label for n, c in report.families.items()},
                "forms_summary": _forms(report),
                "seconds": time.perf_counter() - t,
                "report": report.to_json(),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    parser.add_argument(
        "--synthetic-layers", type=int, default=8, help="layers of the synthetic model"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench-results" / "bench_budget.json",
        help="write the results as JSON here",
    )
    parser.add_argument(
        "--no-align",
        action="store_true",
        help="skip the aligned rows (function-preserving alignment before the budget)",
    )
    args, unknown = parser.parse_known_args()
    if unknown:
        print(f"bench_budget: ignoring options of other benchmarks: {' '.join(unknown)}")
    L = args.synthetic_layers
    models = {
        "demo": (demo_config(), demo_families()),
        f"synthetic-{L}L": (synthetic_config(L), synthetic_families(L)),
        f"scrambled-{L}L": (synthetic_config(L), synthetic_families(L, scramble=True)),
    }
    rows = []
    for name, (config, families) in models.items():
        rows += run(name, families, args.budgets)
        if not args.no_align:
            rows += run(f"{name}+align", aligned(config, families), args.budgets)
    header = (
        f"{'model':<20} {'budget':>6} {'stored':>7} {'auto err':>9} {'measured':>9} "
        f"{'SVD err':>9} {'auto-SVD':>9}  forms chosen"
    )
    print(header)
    for r in rows:
        print(
            f"{r['model']:<20} {r['budget']:>6.2f} {r['stored_over_dense']:>7.4f} "
            f"{r['auto_error']:>9.5f} {r['auto_error_measured']:>9.5f} "
            f"{r['lowrank_global_error']:>9.5f} {r['difference']:>+9.5f}  {r['forms_summary']}"
        )
    worst = max(r["difference"] for r in rows)
    print(
        f"auto never above per-layer SVD with global ranks: {worst <= 1e-12} (max diff {worst:+.2e})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"benchmark": "budget", "budgets": args.budgets, "rows": rows}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
