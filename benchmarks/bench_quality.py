"""Quality by function: held-out perplexity, top-1 agreement and KL of compressed demo models.

On the embedded demo model (a trained float32 6-layer Llama), or any model with the demo's
tokenizer (``--model PATH``: the demo's shipped calibration and held-out samples apply to it),
at each budget (stored over dense parameters of the projections) this compresses the model
several ways and judges every result on the same held-out text in one run (attnquant-core's
numpy forward):

* ``svd_weight_global`` — (a) per-layer truncated SVD of the weights, ranks allocated
  globally by weight error per parameter (``decompose_budget(forms=["lowrank"])``);
* ``svd_whitened_uniform`` — (b) SVD-LLM: per-layer whitened truncated SVD (``W S``,
  ``S S^T = sum x x^T`` of the projection's calibration inputs, then ``V^T S^{-1}``), every
  matrix at the same parameter ratio (numpy, here);
* ``svd_whitened_global`` — whitened per-layer SVD with ranks allocated globally by the
  whitened spectra (``decompose_budget(forms=["lowrank"], calibration=...)``);
* ``svd_whitened_sensitivity`` — the same, ranks allocated by each projection's whitened
  error weighed by its measured KL sensitivity (``allocation="sensitivity"``: the weights
  ``attnquant calibrate --sensitivity`` measures on the calibration windows, never the
  held-out ones);
* ``attnquant_auto`` — ``attnquant decompose --budget``: the auto form, weight error;
* ``attnquant_auto_calibrated`` — (c) ``attnquant decompose --budget --calibration
  --allocation global``: the auto form fitted for the output error.
* ``attnquant_auto_sensitivity`` — (c) with ``--allocation sensitivity`` (the default where
  the sensitivities were measured beside the statistics, as they are here).
* ``attnquant_auto_sequential`` — (c) with ``--calibration-data --sequential``
  (``decompose_calibrated``): the same allocation (dense-input whitened spectra, from the
  same calibration windows), then each layer fit against the compressed model's own inputs.
* ``attnquant_auto_sequential_sensitivity`` — the same with ``--allocation sensitivity``
  (the sensitivities measured in the pass, on the same calibration windows).

Beside them, ``attnquant verify``'s native-equivalence criteria (max |delta log p| < 1 of the
base's 32 greedy tokens after each verify prompt, greedy agreement >= 90%) computed in the
numpy float32 forward (not MAX), and the smallest budget at which each method passes them.

Statistics come from ``attnquant calibrate``'s code on the demo's shipped calibration sample
(files of its training split); the held-out text is the shipped held-out sample (files it was
not trained on). The perplexity ratio is to the dense model on the same windows.

Run: ``uv run --all-packages --group bench python benchmarks/bench_quality.py`` (or
``uv run nox -s bench -- bench_quality``); the JSON goes to ``--out``, by default
``bench-results/bench_quality.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import safetensors.numpy

from attnquant_cli._prompts import VERIFY_PROMPTS
from attnquant_core import FAMILIES, ThetaCheckpoint, decompose_budget
from attnquant_core.calib import (
    SENSITIVITY_SAMPLES,
    EvalResult,
    ModelSource,
    calibrate,
    decompose_calibrated,
    evaluate,
    measure_sensitivity,
    open_source,
    peak_rss_bytes,
    read_stats,
    read_texts,
    sensitivity_path,
    token_stream,
    token_windows,
    whitening,
)
from attnquant_core.gemma_reference import gemma3_logits
from attnquant_core.llama_reference import llama_logits

BUDGETS = (0.9, 0.8, 0.7, 0.5)
ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "packages/attnquant-cli/src/attnquant_cli"
DEMO = CLI / "demo_model"
CALIBRATION = CLI / "data/demo_calibration.jsonl"
HELDOUT = CLI / "data/demo_heldout.jsonl"
PROJECTIONS = FAMILIES


def projection_keys(config: dict) -> list[str]:
    return [
        f"model.layers.{layer}.{name}.weight"
        for layer in range(config["num_hidden_layers"])
        for name in PROJECTIONS
    ]


def uniform_ranks(shapes: dict[str, tuple[int, int]], budget: float) -> dict[str, int]:
    """Every matrix at the same parameter ratio: ``r = floor(budget * out * in / (out + in))``."""
    return {k: min(int(budget * o * i / (o + i)), o, i) for k, (o, i) in shapes.items()}


def compress(
    state: dict[str, np.ndarray],
    ranks: dict[str, int],
    fit: Callable[[str, np.ndarray, int], tuple[np.ndarray, np.ndarray]],
) -> tuple[dict[str, np.ndarray], int]:
    """The dense state with each projection replaced by its rank-``ranks[k]`` fit, and the
    stored parameters of the projections."""
    out = dict(state)
    stored = 0
    for key, r in ranks.items():
        U, V = fit(key, state[key], r)
        out[key] = (U @ V.T).astype(state[key].dtype)
        stored += r * sum(state[key].shape)
    return out, stored


#: ``attnquant verify``'s prompts (shared with the CLI) and thresholds (docs/serving-paths.md).
VERIFY_NEW_TOKENS, VERIFY_MAX_DELTA, VERIFY_MIN_AGREEMENT = 32, 1.0, 0.9


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def tokenizer_dir(model: Path) -> Path:
    """The model's own ``tokenizer.json``, else the demo's (a model trained on its tokenizer)."""
    return model if (model / "tokenizer.json").is_file() else DEMO


def reference_logits(config: dict, state: dict, ids: list[int]) -> np.ndarray:
    """The numpy float32 forward of ``config``'s architecture: Gemma 3's, else Llama's."""
    archs = config.get("architectures") or []
    forward = gemma3_logits if any(a.startswith("Gemma3") for a in archs) else llama_logits
    return forward(config, state, ids, dtype=np.float32)


def verify_base(
    config: dict, state: dict, model: Path = DEMO
) -> list[tuple[list[int], list[int], np.ndarray]]:
    """Per verify prompt: its ids, the base's greedy continuation and its log-probabilities
    (teacher-forced), as ``attnquant verify`` computes them, in the numpy float32 forward."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir(model) / "tokenizer.json"))
    out = []
    for prompt in VERIFY_PROMPTS:
        ids = tok.encode(prompt).ids
        seq = list(ids)
        for _ in range(VERIFY_NEW_TOKENS):
            seq.append(int(reference_logits(config, state, seq)[-1].argmax()))
        out.append((ids, seq[len(ids) :], log_softmax(reference_logits(config, state, seq))))
    return out


def verify_numpy(config: dict, state: dict, base: list) -> dict[str, float | bool]:
    """``attnquant verify``'s criteria in numpy: max |delta log p| of the base's greedy tokens
    and greedy agreement, over the verify prompts."""
    deltas, agree, total = [], 0, 0
    for ids, cont, lp_base in base:
        seq = ids + cont
        lp = log_softmax(reference_logits(config, state, seq))
        rows = np.arange(len(ids) - 1, len(seq) - 1)
        deltas.append(np.abs(lp[rows, cont] - lp_base[rows, cont]).max())
        agree += int(np.sum(lp[rows].argmax(-1) == lp_base[rows].argmax(-1)))
        total += len(rows)
    delta, agreement = float(max(deltas)), agree / total
    return {
        "max_abs_logprob_delta": delta,
        "agreement": agreement,
        "native_equivalent": delta < VERIFY_MAX_DELTA and agreement >= VERIFY_MIN_AGREEMENT,
    }


def source_of(name: str, config: dict, state: dict[str, np.ndarray]) -> ModelSource:
    return ModelSource(path=Path(name), config=config, keys=frozenset(state), get=state.__getitem__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=DEMO,
        help="a dense Llama checkpoint with the demo's tokenizer (default: the demo)",
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per window")
    parser.add_argument(
        "--heldout-windows", type=int, default=None, help="held-out windows (default: all)"
    )
    parser.add_argument("--damping", type=float, default=1e-2, help="whitening damping")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "bench_quality.json")
    parser.add_argument(
        "--skip-auto", action="store_true", help="leave out attnquant decompose --budget"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="run only these rows (e.g. attnquant_auto_calibrated attnquant_auto_sequential); "
        "a quicker run on a busy machine",
    )
    parser.add_argument(
        "--skip-sequential",
        action="store_true",
        help="leave out decompose --calibration-data --sequential (the slowest rows)",
    )
    parser.add_argument(
        "--sensitivity-samples",
        type=int,
        default=SENSITIVITY_SAMPLES,
        help="calibration windows the sensitivity probe runs on (its time grows with them)",
    )
    args, unknown = parser.parse_known_args()
    if unknown:
        print(f"note: ignoring options of other benchmarks: {unknown}")
    started = time.perf_counter()
    model = args.model
    tok = tokenizer_dir(model)
    config = json.loads((model / "config.json").read_text())
    state = safetensors.numpy.load_file(str(model / "model.safetensors"))
    keys = projection_keys(config)
    shapes = {k: tuple(state[k].shape) for k in keys}

    # Calibration statistics, through the same code as `attnquant calibrate demo`.
    base = open_source(model)
    calib_windows = token_windows(
        token_stream(tok, read_texts([CALIBRATION]), config), seq_len=args.seq_len, samples=128
    )
    heldout = token_windows(
        token_stream(tok, read_texts([HELDOUT]), config),
        seq_len=args.seq_len,
        samples=args.heldout_windows,
        seed=None,
    )
    scratch = tempfile.TemporaryDirectory(prefix="bench_quality-")  # removed at exit
    tmp = Path(scratch.name)
    t0 = time.perf_counter()
    report = calibrate(base, calib_windows, tmp / f"{model.name}.stats.safetensors")
    calib_s = time.perf_counter() - t0
    stats = read_stats(report.path)
    whites = {
        k: whitening(stats.gram(k), damping=args.damping, where=f"{k} input gram") for k in keys
    }
    print(
        f"calibration: {report.tokens} tokens ({report.sequences} x {report.seq_len}) in "
        f"{calib_s:.1f} s; held-out: {heldout.shape[0]} x {heldout.shape[1]} tokens",
        flush=True,
    )

    # Whitened spectra for SVD-LLM's uniform ratio (one SVD per matrix, reused for every budget).
    white_svd = {k: np.linalg.svd(whites[k].whiten(state[k]), full_matrices=False) for k in keys}

    def fit_whitened(key: str, W: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
        P, s, Qt = white_svd[key]
        return P[:, :r] * s[:r], whites[key].unwhiten(Qt[:r].T)

    methods: dict[str, Callable[[float], tuple[dict, int]]] = {
        "svd_whitened_uniform": lambda b: compress(state, uniform_ranks(shapes, b), fit_whitened),
    }
    # Through core, written as theta checkpoints: (method, forms, calibrated, allocation). The
    # global rows say so: unset, a budget takes the sensitivities written beside the statistics.
    core_methods = [
        ("svd_weight_global", ["lowrank"], False, None),
        ("svd_whitened_global", ["lowrank"], True, "global"),
        ("svd_whitened_sensitivity", ["lowrank"], True, "sensitivity"),
    ]
    if not args.skip_auto:
        core_methods += [
            ("attnquant_auto", None, False, None),
            ("attnquant_auto_calibrated", None, True, "global"),
            ("attnquant_auto_sensitivity", None, True, "sensitivity"),
        ]
    wanted = set(args.methods) if args.methods else None
    if wanted is not None:
        methods = {k: v for k, v in methods.items() if k in wanted}
        core_methods = [m for m in core_methods if m[0] in wanted]
    # Each projection's KL sensitivity (the sensitivity allocation), on the calibration windows,
    # beside the statistics as `attnquant calibrate --sensitivity` writes it.
    sensitivity, sensitivity_s = None, 0.0
    if any(m[3] == "sensitivity" for m in core_methods):
        t0 = time.perf_counter()
        sensitivity = measure_sensitivity(
            base,
            calib_windows,
            stats,
            samples=args.sensitivity_samples,
            progress=lambda done, total: print(
                f"  sensitivity {done}/{total} ({time.perf_counter() - t0:.0f} s)", flush=True
            ),
        )
        sensitivity.write(sensitivity_path(report.path))
        sensitivity_s = time.perf_counter() - t0
        print(f"sensitivity: {sensitivity.tokens} tokens in {sensitivity_s:.1f} s", flush=True)
    sequential_rows = [  # (method, allocation): decompose --calibration-data, sequential
        ("attnquant_auto_sequential", None),
        ("attnquant_auto_sequential_sensitivity", "sensitivity"),
    ]
    if args.skip_auto or args.skip_sequential:
        sequential_rows = []
    sequential_rows = [r for r in sequential_rows if wanted is None or r[0] in wanted]
    dense_params = sum(o * i for o, i in shapes.values())
    rows = []
    sequential_s: dict[str, dict[float, float]] = {}
    ranks: dict[tuple[float, str], dict[str, list[int]]] = {}  # per family, per layer
    parity_base = verify_base(config, state, model)
    for budget in args.budgets:
        sources, meta = [base], []
        for name, make in methods.items():
            compressed, stored = make(budget)
            sources.append(source_of(f"{name}@{budget}", config, compressed))
            meta.append(
                (name, stored / dense_params, verify_numpy(config, compressed, parity_base))
            )
        for name, forms, calibrated, allocation in core_methods:
            out = tmp / f"{name}-{budget}"
            fitted = decompose_budget(
                model,
                out,
                budget=budget,
                **({} if forms is None else {"forms": forms}),
                calibration=report.path if calibrated else None,
                allocation=allocation,
            )
            sources.append(open_source(out))
            rebuilt = dict(ThetaCheckpoint.open(out).rebuilt_state())
            parity = verify_numpy(config, rebuilt, parity_base)
            meta.append((name, fitted.stored / fitted.dense, parity))
            ranks[(budget, name)] = {n: list(c.ranks) for n, c in fitted.families.items()}
        for name, allocation in sequential_rows:
            out = tmp / f"{name}-{budget}"
            t0 = time.perf_counter()
            manifest = decompose_calibrated(
                base,
                calib_windows,
                out,
                budget=budget,
                sequential=True,
                damping=args.damping,
                allocation=allocation,
            )
            sequential_s.setdefault(name, {})[budget] = round(time.perf_counter() - t0, 1)
            sources.append(open_source(out))
            rebuilt = dict(ThetaCheckpoint.open(out).rebuilt_state())
            parity = verify_numpy(config, rebuilt, parity_base)
            achieved = manifest["budget"]["stored_over_dense"]
            meta.append((name, achieved, parity))
            ranks[(budget, name)] = {n: f["ranks"] for n, f in manifest["families"].items()}
        t0 = time.perf_counter()
        results = evaluate(sources, heldout)
        eval_s = time.perf_counter() - t0
        dense = results[0]
        for (name, achieved, parity), r in zip(meta, results[1:], strict=True):
            rows.append(
                {
                    "budget": budget,
                    "method": name,
                    "stored_fraction": round(float(achieved), 4),
                    "perplexity": r.perplexity,
                    "perplexity_ratio": r.perplexity / dense.perplexity,
                    "top1_agreement": r.top1,
                    "kl": r.kl,
                    "verify_numpy": parity,
                    **({"ranks": ranks[(budget, name)]} if (budget, name) in ranks else {}),
                }
            )
            print(
                f"budget {budget:.2f} {name:<37} ppl {r.perplexity:8.3f} "
                f"(x{r.perplexity / dense.perplexity:.4f})  top-1 {100 * r.top1:6.2f}%  "
                f"KL {r.kl:.4f}  verify max|dlogp| {parity['max_abs_logprob_delta']:.2f} "
                f"agree {100 * parity['agreement']:.0f}% "
                f"{'PASS' if parity['native_equivalent'] else 'fail'}",
                flush=True,
            )
        print(f"  (eval {eval_s:.1f} s, dense ppl {dense.perplexity:.3f})", flush=True)
    passing = {}
    for row in rows:
        if row["verify_numpy"]["native_equivalent"]:
            passing[row["method"]] = min(passing.get(row["method"], 1.0), row["budget"])
    print(f"smallest budget passing verify's criteria (numpy float32): {passing}")
    result = {
        "model": "demo" if model.resolve() == DEMO.resolve() else str(model),
        "smallest_budget_passing_verify_numpy": passing,
        "forward": "numpy float32",
        "calibration": {
            "data": str(CALIBRATION.relative_to(ROOT)),
            "tokens": report.tokens,
            "damping": args.damping,
            "seconds": round(calib_s, 1),
            "sensitivity_tokens": None if sensitivity is None else sensitivity.tokens,
            "sensitivity_samples": None if sensitivity is None else args.sensitivity_samples,
            "sensitivity_seconds": round(sensitivity_s, 1),
        },
        "heldout": heldout_record(str(HELDOUT.relative_to(ROOT)), heldout, dense),
        "sequential_fit_seconds": sequential_s,
        "rows": rows,
    }
    scratch.cleanup()
    write_result(args.out, result, started)


def heldout_record(data: str | list[str], heldout: np.ndarray, dense: EvalResult) -> dict:
    """What a run was judged on: the held-out text, its windows and the dense model's score."""
    return {
        "data": data,
        "windows": int(heldout.shape[0]),
        "seq_len": int(heldout.shape[1]),
        "predictions": dense.tokens,
        "dense_perplexity": dense.perplexity,
    }


def write_result(out: Path, result: dict, started: float) -> None:
    """``result`` with the run's wall time (since ``started``) and peak RSS, as JSON at ``out``."""
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["peak_rss_bytes"] = peak_rss_bytes()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} ({result['wall_s']} s)")


if __name__ == "__main__":
    main()
