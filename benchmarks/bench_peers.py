"""Peers at equal bits: attnquant's 4-bit variants against llama.cpp's Q4_0, Q4_K_M and imatrix.

On one trained Llama checkpoint (``--model demo`` or a directory), every row is judged on the
same held-out token windows (our tokenizer, attnquant-core's numpy float32 forward, the
perplexity ratio, top-1 agreement and mean KL(dense || row) of
:func:`attnquant_core.calib.evaluate`, as in ``bench_quality.py`` and docs/results.md):

* ``dense`` — the float32 checkpoint;
* attnquant (``attnquant decompose``): NVFP4 ``W0`` at passthrough, rank 0, round to nearest
  (no statistics); GPTQ-rounded (``--calibration``); GPTQ + a rank-16 correction; the GPTQ
  row with the output head also in NVFP4 (``serve --quant-head``: round to nearest at load,
  emulated here); ``--budget B --quant nvfp4 --calibration`` at each ``--budgets`` value
  (stored over float32 bytes of the projections). Embedding and norms stay float32 (and the
  head, but in the ``4-bit head`` row);
* llama.cpp (``llama-quantize`` on a float32 GGUF of the same weights, read back with the
  ``gguf`` package into the same numpy forward): each ``--llama`` type, ``+imatrix`` with
  ``llama-imatrix`` over the very calibration text attnquant calibrates on (written so that
  llama.cpp tokenizes it into our token stream; checked with ``llama-server``'s
  ``/tokenize``), ``+f32io`` keeping the embedding and head float32
  (``--token-embedding-type f32 --output-tensor-type f32``), as attnquant does, ``+pure``
  one type for every projection (``--pure``: Q4_K_M without its Q6_K layers, all Q4_K).

Bits per weight come from the bytes actually stored: the GGUF tensors' ``n_bytes``, the theta
checkpoint's safetensors tensors; over the seven projections alone and over every weight.

Run: ``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_peers.py --model demo --out
bench-results/bench_peers-demo.json`` (needs ``python benchmarks/llamacpp.py build`` first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp
from bench_quality import (
    CALIBRATION,
    DEMO,
    HELDOUT,
    ROOT,
    heldout_record,
    source_of,
    write_result,
)

from attnquant_core import (
    FAMILIES,
    DecomposeSpec,
    decompose_budget,
    decompose_checkpoint,
    dequantize_nvfp4,
    quantize_nvfp4,
)
from attnquant_core.calib import (
    ModelSource,
    calibrate,
    evaluate,
    open_source,
    read_texts,
    token_stream,
    token_windows,
)

BUDGETS = (0.10, 0.125, 0.15)
LLAMA_ROWS = (
    "Q4_0",
    "Q4_K_M",
    "Q4_K_M+imatrix",
    "Q4_K_M+imatrix+f32io",
    "Q4_K_M+imatrix+pure+f32io",
    "IQ4_XS+imatrix",
    "Q3_K_M+imatrix",
)
HEAD = "lm_head.weight"


@dataclasses.dataclass
class Row:
    name: str
    command: str
    quantized: str
    source: ModelSource
    sizes: dict[str, int]  # stored bytes per tensor (HF key, or theta / GGUF tensor key)
    projection_bytes: int
    types: dict[str, str] | None = None
    fit_s: float = 0.0
    note: str = ""


def safetensors_sizes(directory: Path) -> dict[str, int]:
    """Bytes of every tensor stored in ``directory``'s safetensors files (from their headers)."""
    sizes = {}
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, entry in header.items():
            if key != "__metadata__":
                begin, end = entry["data_offsets"]
                sizes[key] = end - begin
    return sizes


def is_projection(key: str) -> bool:
    """A projection's tensor: a layer's family weight or theta tensor, or a shared ``W0``."""
    return key.startswith("attnquant.") or any(f".{fam}." in key for fam in FAMILIES)


_FORMS = {
    "banded+nvfp4": "NVFP4 W0 and float32 s, U, V",
    "banded": "float32 banded W0, s, U, V",
    "lowrank": "float32 low rank U V^T",
    "shared_basis": "float32 shared basis",
}


def theta_row(name: str, command: str, out: Path, fit_s: float) -> Row:
    sizes = safetensors_sizes(out)
    manifest = json.loads((out / "attnquant.json").read_text())
    proj = sum(n for k, n in sizes.items() if is_projection(k))
    forms = {
        f["form"] + ("+" + f["quant"] if f.get("quant") else "")
        for f in manifest["families"].values()
    }
    what = (
        "projections ("
        + ", ".join(_FORMS[f] for f in sorted(forms))
        + "); embedding, norms, head float32"
    )
    return Row(name, command, what, open_source(out), sizes, proj, fit_s=fit_s)


def with_nvfp4_head(row: Row) -> Row:
    """``row`` served with ``--quant-head``: the head (or the tied embedding) in NVFP4, rounded
    to nearest at load as attnquant_core.serving does; the head's bytes counted as NVFP4."""
    src = row.source
    key = HEAD if src.has_key(HEAD) else f"{src.prefix}.embed_tokens.weight"
    W = np.asarray(src.get(key), np.float32)
    Wq = dequantize_nvfp4(quantize_nvfp4(W, name=key))

    def get(k: str) -> np.ndarray:
        return Wq if k == HEAD else src.get(k)

    source = dataclasses.replace(
        src, path=Path(f"{src.path}+head"), keys=src.keys | {HEAD}, get=get
    )
    sizes = dict(row.sizes)
    sizes[HEAD] = W.size // 2 + W.size // 16 + 4
    return dataclasses.replace(
        row,
        name=row.name + ", 4-bit head",
        command=row.command + "; serve --quant-head",
        quantized="projections and head (NVFP4, head round to nearest); embedding, norms float32",
        source=source,
        sizes=sizes,
    )


def gguf_row(name: str, command: str, path: Path, config: dict) -> Row:
    import gguf

    state, sizes = llamacpp.gguf_state(path)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    proj = sum(n for k, n in sizes.items() if is_projection(k))
    groups: dict[str, Counter] = {"projections": Counter(), "embedding": Counter()}
    groups["head"] = Counter()
    for gname, t in types.items():
        if gname.startswith("blk.") and "norm" not in gname:
            groups["projections"][t] += 1
        elif gname == "token_embd.weight":
            groups["embedding"][t] += 1
        elif gname == "output.weight":
            groups["head"][t] += 1
    what = "; ".join(
        f"{g}: " + ", ".join(f"{t} x{n}" if n > 1 else t for t, n in sorted(c.items()))
        for g, c in groups.items()
        if c
    )
    return Row(name, command, what, source_of(name, config, state), sizes, proj, types=types)


def llama_text(model: Path, texts: list[str], config: dict) -> str:
    """The calibration documents as one text that llama.cpp (BOS added, special tokens parsed)
    tokenizes into :func:`token_stream`'s ids: documents joined by the EOS and BOS tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos = tok.id_to_token(config["bos_token_id"])
    eos = tok.id_to_token(config["eos_token_id"])
    return "".join((bos if i else "") + t + eos for i, t in enumerate(texts))


def tokenizer_parity(gguf_path: Path, texts: dict[str, tuple[str, np.ndarray]]) -> dict:
    """``llama-server``'s ``/tokenize`` of each text (BOS added, specials parsed) against our ids."""
    import httpx

    out = {}
    with llamacpp.LlamaServer(gguf_path, ctx=512) as server:
        for name, (text, ours) in texts.items():
            body = {"content": text, "add_special": True, "parse_special": True}
            r = httpx.post(f"{server.url}/tokenize", json=body, timeout=600)
            r.raise_for_status()
            theirs = np.asarray(r.json()["tokens"], dtype=np.int64)
            n = min(len(theirs), len(ours))
            diff = np.flatnonzero(theirs[:n] != ours[:n])
            first = int(diff[0]) if len(diff) else (n if len(theirs) != len(ours) else None)
            out[name] = {
                "ours": len(ours),
                "llama_cpp": len(theirs),
                "identical": first is None,
                "first_difference": first,
                "differing_positions": len(diff),
            }
    return out


def attnquant_rows(
    model: Path, label: str, stats: Path, budgets, tmp: Path, fixed: bool = True
) -> list[Row]:
    """attnquant's rows: passthrough, the fixed NVFP4 rows (unless ``fixed`` is false: a run
    that adds budgets to an earlier one) and one ``--budget`` row per budget."""
    if not fixed:
        return [budget_row(model, label, stats, budget, tmp) for budget in budgets]
    out = tmp / "aq-passthrough"
    t0 = time.perf_counter()
    decompose_checkpoint(model, out, spec=DecomposeSpec(blocks="layers", rank=0), overwrite=True)
    command = f"attnquant decompose {label} -o OUT --blocks layers --rank 0"
    rows = [
        theta_row("attnquant passthrough (must be exact)", command, out, time.perf_counter() - t0)
    ]
    plain = [
        ("attnquant NVFP4, round to nearest", 0, None, ""),
        ("attnquant NVFP4, GPTQ", 0, stats, " --calibration STATS"),
        ("attnquant NVFP4, GPTQ + r16", 16, stats, " --calibration STATS"),
    ]
    for name, rank, calibration, flag in plain:
        out = tmp / f"aq-r{rank}-{'gptq' if calibration else 'rtn'}"
        t0 = time.perf_counter()
        spec = DecomposeSpec(quant="nvfp4", rank=rank, calibration=calibration)
        decompose_checkpoint(model, out, spec=spec, overwrite=True)
        command = f"attnquant decompose {label} -o OUT --quant nvfp4 --rank {rank}{flag}"
        rows.append(theta_row(name, command, out, time.perf_counter() - t0))
        print(f"  {name}: {rows[-1].fit_s:.1f} s", flush=True)
        if rank == 0 and calibration is not None:
            rows.append(with_nvfp4_head(rows[-1]))
    rows += [budget_row(model, label, stats, budget, tmp) for budget in budgets]
    return rows


def budget_row(
    model: Path, label: str, stats: Path, budget: float, tmp: Path, why: str = ""
) -> Row:
    """``attnquant decompose --budget B --quant nvfp4 --calibration STATS``."""
    out = tmp / f"aq-budget-{budget}"
    t0 = time.perf_counter()
    spec = DecomposeSpec(budget=budget, quant="nvfp4", calibration=stats)
    manifest = decompose_budget(model, out, spec=spec, overwrite=True).manifest
    command = f"attnquant decompose {label} -o OUT --budget {budget} --quant nvfp4 "
    command += "--calibration STATS"
    row = theta_row(f"attnquant --budget {budget}{why}", command, out, time.perf_counter() - t0)
    row.note = "; ".join(
        f"{fam}: {f['form']}"
        + (f" G={f['blocks']} W0 {f['quant']}" if f.get("quant") else "")
        + f" r={f['ranks']}"
        for fam, f in manifest["families"].items()
    )
    print(f"  budget {budget}: {row.fit_s:.1f} s; {row.note}", flush=True)
    return row


def llama_rows(f32: Path, config: dict, wanted, imat: Path | None, tmp: Path) -> list[Row]:
    rows = []
    for spec in wanted:
        qtype, *flags = spec.split("+")
        use_imatrix, f32io, pure = "imatrix" in flags, "f32io" in flags, "pure" in flags
        extra = ["--token-embedding-type", "f32", "--output-tensor-type", "f32"] if f32io else []
        extra += ["--pure"] if pure else []
        dst = tmp / f"{spec.replace('+', '-')}.gguf"
        t0 = time.perf_counter()
        llamacpp.quantize(f32, dst, qtype, imatrix=imat if use_imatrix else None, extra=extra)
        fit_s = time.perf_counter() - t0
        command = "llama-quantize " + " ".join(extra)
        command += " --imatrix IMATRIX" if use_imatrix else ""
        command += f" F32.gguf OUT.gguf {qtype} 2"
        name = f"llama.cpp {qtype}" + (" + imatrix" if use_imatrix else "")
        name += ", --pure" if pure else ""
        name += ", embd/head F32" if f32io else ""
        row = gguf_row(name, " ".join(command.split()), dst, config)
        row.fit_s = fit_s
        fallback = [ln for ln in dst.with_name(dst.name + ".log").read_text().splitlines()]
        fallback = [ln.strip() for ln in fallback if "fallback" in ln.lower()]
        row.note = fallback[-1].split(": ", 1)[-1] if fallback else ""
        rows.append(row)
        print(f"  {name}: {row.quantized}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo", help="'demo' or a Hugging Face Llama directory")
    parser.add_argument("--calibration", type=Path, nargs="+", default=[CALIBRATION])
    parser.add_argument("--heldout", type=Path, nargs="+", default=[HELDOUT])
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per window")
    parser.add_argument("--heldout-windows", type=int, help="held-out windows (default: all)")
    parser.add_argument("--budgets", type=float, nargs="*", default=list(BUDGETS))
    parser.add_argument("--llama", nargs="*", default=list(LLAMA_ROWS), help="llama.cpp rows")
    parser.add_argument(
        "--match",
        nargs="*",
        default=["Q4_K_M + imatrix", "IQ4_XS + imatrix", "Q3_K_M + imatrix"],
        help="llama.cpp rows (by name) whose projection bytes an attnquant --budget row matches",
    )
    parser.add_argument("--no-parity", action="store_true", help="skip the tokenizer check")
    parser.add_argument(
        "--budgets-only",
        action="store_true",
        help="of attnquant's rows, only the --budgets ones (rows added to an earlier run)",
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        help="the GGUF that `attnquant import` made MODEL from: llama.cpp's rows quantize its "
        "float32 rewrite (same metadata and tokenizer), not a GGUF written from MODEL",
    )
    parser.add_argument("--keep", type=Path, help="keep the checkpoints and GGUFs in this folder")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "bench_peers.json")
    args = parser.parse_args()
    started = time.perf_counter()
    model = DEMO if args.model == "demo" else Path(args.model).resolve()
    label = "demo" if args.model == "demo" else str(args.model)
    config = json.loads((model / "config.json").read_text())
    base = open_source(model)
    dense_sizes = safetensors_sizes(model)
    params = {k: n // 4 for k, n in dense_sizes.items()}  # float32
    proj_params = sum(n for k, n in params.items() if is_projection(k))

    texts = read_texts(args.calibration)
    stream = token_stream(model, texts, config)
    calib = token_windows(stream, seq_len=args.seq_len, samples=None)
    held_texts = read_texts(args.heldout)
    held_stream = token_stream(model, held_texts, config)
    heldout = token_windows(
        held_stream, seq_len=args.seq_len, samples=args.heldout_windows, seed=None
    )
    scratch = None
    if args.keep:
        tmp = args.keep
        tmp.mkdir(parents=True, exist_ok=True)
    else:
        scratch = tempfile.TemporaryDirectory(prefix="bench_peers-")
        tmp = Path(scratch.name)
    t0 = time.perf_counter()
    report = calibrate(base, calib, tmp / "stats.safetensors")
    print(
        f"calibration: {report.tokens} tokens ({report.sequences} x {report.seq_len}) in "
        f"{time.perf_counter() - t0:.1f} s; held-out: {heldout.shape[0]} x {heldout.shape[1]}",
        flush=True,
    )
    rows = attnquant_rows(model, label, report.path, args.budgets, tmp, not args.budgets_only)

    llama: dict = {}
    if args.llama:
        marker = llamacpp.cache_root() / f"llama.cpp-{llamacpp.LLAMA_CPP_PYTHON}" / "built.json"
        llama["build"] = json.loads(marker.read_text()) if marker.exists() else None
        if args.gguf:
            from attnquant_core.io import dequantize_gguf, gguf_source

            record = gguf_source(model)
            if record is None or record["source"] != args.gguf.name:
                raise SystemExit(f"{model} was not imported from {args.gguf}")
            f32 = dequantize_gguf(args.gguf, tmp / "F32.gguf")
            llama["source_gguf"] = {
                "file": args.gguf.name,
                "types": sorted(set(record["tensors"].values())),
            }
        else:
            f32 = llamacpp.hf_to_gguf(model, tmp / "F32.gguf")
        text_file = tmp / "calibration.txt"
        text_file.write_text(llama_text(model, texts, config), encoding="utf-8")
        imat = None
        if any("imatrix" in r for r in args.llama):
            imat = tmp / "imatrix.gguf"
            t0 = time.perf_counter()
            llamacpp.imatrix(
                f32, text_file, imat, ctx=args.seq_len, chunks=len(calib), parse_special=True
            )
            llama["imatrix_s"] = round(time.perf_counter() - t0, 1)
            log = imat.with_name(imat.name + ".log").read_text(errors="replace").splitlines()
            llama["imatrix_log"] = [ln for ln in log if "chunks" in ln or "tokeniz" in ln]
            llama["imatrix_command"] = (
                f"llama-imatrix -m F32.gguf -f calibration.txt -o IMATRIX -t 2 "
                f"-c {args.seq_len} --chunks {len(calib)} --no-ppl --parse-special"
            )
        if not args.no_parity:
            held_text = llama_text(model, held_texts, config)
            llama["tokenizer_parity"] = tokenizer_parity(
                f32,
                {
                    "calibration": (text_file.read_text(encoding="utf-8"), stream),
                    "heldout": (held_text, held_stream),
                },
            )
            print(f"tokenizer parity: {llama['tokenizer_parity']}", flush=True)
        peers = llama_rows(f32, config, args.llama, imat, tmp)
        rows += peers
        for peer in peers:  # attnquant at the very projection bytes of a llama.cpp row
            if peer.name.removeprefix("llama.cpp ") in args.match:
                budget = math.floor(peer.projection_bytes / (4 * proj_params) * 1e4) / 1e4
                why = f" (= {peer.name.removeprefix('llama.cpp ')}'s bytes)"
                stem = f"attnquant --budget {budget}"
                same = [r for r in rows if r.name == stem or r.name.startswith(stem + " (")]
                if same:  # that budget is a row already
                    same[0].name += why
                else:
                    rows.append(budget_row(model, label, report.path, budget, tmp, why))

    t0 = time.perf_counter()
    results = evaluate([base, *(r.source for r in rows)], heldout)
    eval_s = time.perf_counter() - t0
    dense = results[0]
    table = [
        "| row | bits/w projections | bits/w all weights | ppl ratio | top-1 | KL |",
        "|---|---|---|---|---|---|",
        f"| dense float32 | 32.00 | 32.00 | 1.0000 (ppl {dense.perplexity:.3f}) | 100% | 0 |",
    ]
    out_rows = []
    for row, r in zip(rows, results[1:], strict=True):
        total = sum(row.sizes.values())
        bits_proj = 8 * row.projection_bytes / proj_params
        bits_all = 8 * total / sum(params.values())
        out_rows.append(
            {
                "row": row.name,
                "command": row.command,
                "quantized": row.quantized,
                "projection_bytes": row.projection_bytes,
                "total_bytes": total,
                "bits_per_weight_projections": bits_proj,
                "bits_per_weight_all": bits_all,
                "perplexity": r.perplexity,
                "perplexity_ratio": r.perplexity / dense.perplexity,
                "top1_agreement": r.top1,
                "kl": r.kl,
                "fit_s": round(row.fit_s, 1),
                "note": row.note,
                "gguf_types": row.types,
            }
        )
        table.append(
            f"| {row.name} | {bits_proj:.2f} | {bits_all:.2f} | "
            f"{r.perplexity / dense.perplexity:.4f} | {100 * r.top1:.2f}% | {r.kl:.5f} |"
        )
    print("\n".join(table))
    print("\nwhat each row quantized:")
    for row in rows:
        print(f"* {row.name}: {row.quantized}" + (f" ({row.note})" if row.note else ""))
    result = {
        "model": label,
        "config": {
            k: config.get(k)
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "vocab_size",
                "tie_word_embeddings",
            )
        },
        "forward": "attnquant-core numpy float32 (llama.cpp rows dequantized with the gguf package)",
        "parameters": {"projections": proj_params, "all": sum(params.values())},
        "calibration": {
            "data": [str(p) for p in args.calibration],
            "tokens": report.tokens,
            "windows": report.sequences,
            "seq_len": report.seq_len,
        },
        "heldout": heldout_record([str(p) for p in args.heldout], heldout, dense),
        "llama_cpp": llama,
        "rows": out_rows,
        "table": table,
        "eval_s": round(eval_s, 1),
    }
    if scratch is not None:
        scratch.cleanup()
    write_result(args.out, result, started)


if __name__ == "__main__":
    main()
