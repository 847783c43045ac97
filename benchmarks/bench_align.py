"""Does function-preserving alignment (--align) bring a model's layers closer to their band mean?

On the embedded demo model (or ``--model PATH``), per projection family: the relative distance
of the layers to their band mean (``sqrt(sum ||W_l - W0_b||^2 / sum ||W_l||^2)``) and the
relative error of banded theta at ``--blocks``/``--rank`` (``attnquant_core.decompose_family``),
before and after ``align_state``; plus how far the aligned model's logits move (numpy Llama
reference, float64 and float32 forwards, on a fixed 16-token prompt) and the alignment time.

Run: ``uv run --all-packages --group bench python benchmarks/bench_align.py`` (or
``uv run nox -s bench``). Writes ``bench-results/align.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [0, 316, 223, 399, 10, 72, 303, 270, 363, 899, 273, 623, 725, 595, 201, 376]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "align.json")
    parser.add_argument("--model", type=Path, help="a dense Llama checkpoint (default: demo)")
    parser.add_argument("--blocks", type=int, default=1, help="G of the bands and of theta")
    parser.add_argument("--rank", type=int, default=8, help="r of the theta fit")
    parser.add_argument("--rounds", type=int, default=3, help="alignment rounds")
    args = parser.parse_args()

    from attnquant_core import decompose_family, open_checkpoint
    from attnquant_core.fit import align_state
    from attnquant_core.llama_reference import llama_logits

    if args.model is None:
        from attnquant_cli import demo_model_path

        args.model = demo_model_path()
    ckpt = open_checkpoint(args.model)
    state = {k: ckpt.get(k) for k in ckpt.keys()}
    t0 = time.perf_counter()
    aligned, transforms = align_state(ckpt.config, state, blocks=args.blocks, rounds=args.rounds)
    align_s = time.perf_counter() - t0

    rows = []
    for name, info in ckpt.families.items():
        before, after = transforms.distances[name]
        fits = [
            decompose_family(
                [s[k] for k in info.keys], blocks=args.blocks, rank=args.rank, name=name
            )[1].total
            for s in (state, aligned)
        ]
        rows.append(
            {
                "family": name,
                "distance_before": before,
                "distance_after": after,
                "theta_error_before": fits[0],
                "theta_error_after": fits[1],
            }
        )
    logits = {}
    for dtype in (np.float64, np.float32):
        ref = llama_logits(ckpt.config, state, PROMPT, dtype=dtype)
        got = llama_logits(ckpt.config, aligned, PROMPT, dtype=dtype)
        logits[np.dtype(dtype).name] = {
            "max_abs_delta": float(np.abs(got - ref).max()),
            "max_abs_logit": float(np.abs(ref).max()),
            "argmax_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1))),
        }

    print(
        f"model {args.model}  blocks={args.blocks} rank={args.rank} rounds={args.rounds}  "
        f"alignment {align_s:.1f}s"
    )
    print(
        f"{'family':<18} {'dist before':>11} {'dist after':>10} {'ratio':>6} "
        f"{'theta err before':>16} {'theta err after':>15} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['family']:<18} {r['distance_before']:>11.4f} {r['distance_after']:>10.4f} "
            f"{r['distance_after'] / r['distance_before']:>6.3f} "
            f"{r['theta_error_before']:>16.4f} {r['theta_error_after']:>15.4f} "
            f"{r['theta_error_after'] / r['theta_error_before']:>6.3f}"
        )
    for name, d in logits.items():
        print(
            f"logits ({name} forward): max |delta| {d['max_abs_delta']:.2e} "
            f"(max |logit| {d['max_abs_logit']:.1f}), argmax agreement {d['argmax_agreement']:.0%}"
        )
    for note in transforms.notes:
        print(f"note: {note}")

    result = {
        "benchmark": "align",
        "model": str(args.model),
        "blocks": args.blocks,
        "rank": args.rank,
        "rounds": args.rounds,
        "align_s": align_s,
        "rows": rows,
        "logits": logits,
        "notes": list(transforms.notes),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
