"""lm-eval's ``local-completions`` model against ``attnquant serve``: a client nobody here wrote.

Three small tasks are made from the demo's held-out text (CPython's ``tempfile.py``,
``urllib/robotparser.py``, ``idlelib/undo.py``, never trained on; shipped in attnquant-cli's
``data/demo_heldout.jsonl``), seeded, so every run scores the same items:

* ``aq_code_choice`` (log-likelihood, multiple choice): three lines of context and the first
  part of a line (cut before the space nearest its middle); the true rest of the line against
  the rests of three other lines. acc, acc_norm.
* ``aq_code_line`` (generate-until): four lines of context and the first part of a line; the
  rest of the line greedily, cut at ``"\\n"``. exact_match.
* ``aq_heldout_ppl`` (rolling log-likelihood): the held-out files in 1,500-character pieces.
  word and byte perplexity, bits per byte.

Each checkpoint is served by ``attnquant serve`` on a free loopback port and scored through
lm-eval's Python API with its remote tokenizer (the server's ``/tokenize`` routes), token-id
prompts, and 2 concurrent requests. Nothing is downloaded: the tasks read local JSON files
(``HF_DATASETS_OFFLINE=1``).

Run: ``uv run nox -s lm-eval`` (installs lm-eval), or
``uv run --all-packages --group lm-eval python benchmarks/lm_eval_demo.py --out lm_eval.json``;
``--model LABEL=PATH`` (repeated) scores other checkpoints on the same tasks, e.g. the imported
Gemma 3 270M: ``uv run nox -s lm-eval -- --model gemma3=PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import wait_healthy

TASKS = ("aq_code_choice", "aq_code_line", "aq_heldout_ppl")
MAX_LENGTH = 512  # attnquant serve's default window


def heldout_texts() -> list[str]:
    from attnquant_cli import demo_model_path

    data = demo_model_path().parent / "data" / "demo_heldout.jsonl"
    return [json.loads(line)["text"] for line in data.read_text(encoding="utf-8").splitlines()]


def make_tasks(folder: Path, *, seed: int = 0, choices: int = 120, lines: int = 60) -> None:
    """The three tasks' JSON Lines data and lm-eval YAML configs, written into ``folder``."""
    rng = random.Random(seed)
    texts = heldout_texts()
    code = [line for text in texts for line in text.splitlines()]
    usable = [i for i in range(4, len(code)) if len(code[i].strip()) >= 24 and code[i - 1].strip()]

    def context(i: int, n: int) -> str:
        return "\n".join(code[i - n : i]) + "\n"

    def split(line: str) -> int:
        """Where a line is cut: before the space nearest its middle, so that the cut falls
        between two tokens (BPE words carry their leading space), not inside one."""
        spaces = [k for k, c in enumerate(line) if c == " " and line[:k].strip()]
        return min(spaces, key=lambda k: abs(k - len(line) // 2)) if spaces else len(line) // 2

    rests = [code[i][split(code[i]) :] for i in usable]
    picks = rng.sample(usable, choices)
    with open(folder / "code_choice.jsonl", "w", encoding="utf-8") as sink:
        for i in picks:
            cut = split(code[i])
            truth = code[i][cut:]
            others = rng.sample([r for r in rests if r != truth], 3)
            options = [truth, *others]
            rng.shuffle(options)
            doc = {"context": context(i, 3) + code[i][:cut], "choices": options}
            sink.write(json.dumps({**doc, "gold": options.index(truth)}) + "\n")
    with open(folder / "code_line.jsonl", "w", encoding="utf-8") as sink:
        for i in rng.sample(usable, lines):
            cut = split(code[i])
            doc = {"context": context(i, 4) + code[i][:cut], "target": code[i][cut:]}
            sink.write(json.dumps(doc) + "\n")
    with open(folder / "heldout.jsonl", "w", encoding="utf-8") as sink:
        for text in texts:
            for start in range(0, len(text), 1500):
                sink.write(json.dumps({"text": text[start : start + 1500]}) + "\n")

    def data(name: str) -> str:
        files = json.dumps({"test": str(folder / name)})
        return f"dataset_path: json\ndataset_kwargs:\n  data_files: {files}\ntest_split: test\n"

    (folder / "aq_code_choice.yaml").write_text(
        "task: aq_code_choice\n" + data("code_choice.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'
    )
    (folder / "aq_code_line.yaml").write_text(
        "task: aq_code_line\n" + data("code_line.jsonl") + "output_type: generate_until\n"
        'doc_to_text: context\ndoc_to_target: target\ntarget_delimiter: ""\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 48\n  do_sample: false\n'
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n"
    )
    (folder / "aq_heldout_ppl.yaml").write_text(
        "task: aq_heldout_ppl\n" + data("heldout.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: text\nmetric_list:\n  - metric: word_perplexity\n'
        "  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )


def serve(model: str, log: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """``attnquant serve MODEL`` on a free port, once ``/health`` answers."""
    from attnquant_max.gateway import free_port

    port = free_port()
    argv = [sys.executable, "-m", "attnquant_cli", "serve", model, "--port", str(port)]
    argv += ["--served-model-name", "m", *extra]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log)
    return proc, url


def score(url: str, tasks: Path, concurrent: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{url}/v1/completions",
            "model": "m",
            "tokenizer_backend": "remote",
            "num_concurrent": concurrent,
            "max_retries": 1,
            "max_length": MAX_LENGTH - 8,  # a rolling window plus the one token asked for
            "timeout": 600,
        },
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks)),
        random_seed=0,
        numpy_random_seed=0,
        fewshot_random_seed=0,
        log_samples=True,
    )
    for sample in results["samples"]["aq_code_line"][:3]:  # what greedy lines look like
        got = sample["filtered_resps"][0]
        print(f"  target {sample['target']!r}\n  served {got!r}", flush=True)
    out = {}
    for task, metrics in results["results"].items():
        out[task] = {
            k.split(",")[0]: v
            for k, v in metrics.items()
            if "," in k and not k.split(",")[0].endswith("_stderr")
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results JSON")
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument(
        "--budget", default="0.5", help="also score the demo fit at this budget ('' to skip)"
    )
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="score this checkpoint (dense or theta) instead of the demo; repeat for more "
        "(the tasks are the demo's held-out Python, whatever the model)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="aq-lm-eval-"))
    make_tasks(work)
    given = dict(m.split("=", 1) if "=" in m else (Path(m).name, m) for m in args.model)
    models = given or {"demo": "demo"}
    if args.budget and not given:
        fit = work / f"demo-budget-{args.budget}"
        subprocess.run(
            [sys.executable, "-m", "attnquant_cli", "decompose", "demo", "-o", str(fit),
             "--budget", args.budget],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        models[f"demo budget {args.budget}"] = str(fit)
    rows = {}
    for label, model in models.items():
        proc, url = serve(model, work / f"{label.replace(' ', '_')}.log", [])
        try:
            start = time.monotonic()
            rows[label] = score(url, work, args.concurrent)
            rows[label]["seconds"] = round(time.monotonic() - start, 1)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        print(label, json.dumps(rows[label], indent=1), flush=True)
    args.out.write_text(json.dumps({"lm_eval": rows, "work": str(work)}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
