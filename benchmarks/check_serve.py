"""``attnquant serve`` of a real model, checked as a client sees it.

For one GGUF (a path, or ``smollm2`` / ``gemma3`` for the real-models packages of the
``real-models`` dependency group), imported with ``attnquant import`` (``--chat-template FILE``
for a GGUF that carries none, as Gemma 3 270M's), this starts ``attnquant serve`` on it and
asks, through the official ``openai`` client:

* a greedy completion, compared with the greedy tokens of attnquant-core's numpy float32
  forward of the same checkpoint;
* the same completion streamed (the chunks joined must be the same text);
* a chat completion with the model's template (its prompt token count checked against the
  template applied by the tokenizer here);
* an echo request (``echo``, ``logprobs``, ``max_tokens`` 0, as lm-eval's log-likelihood asks)
  on a held-out document, compared position by position with the numpy forward: max and median
  |Δ log p| and the share of positions whose top token agrees.

Raw answers are validated against the ``openai`` package's own response types. Prints and
writes one JSON object (``--out``), with the time from start to ready.

Run: ``uv run --all-packages --group bench --group real-models python benchmarks/check_serve.py
gemma3 --chat-template TEMPLATE.jinja``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from scipy.special import log_softmax

sys.path.insert(0, str(Path(__file__).parent))
import real_models
from _servers import wait_healthy

from attnquant_core.calib import final_hidden, open_source, output_head, read_texts

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = (
    ROOT / "packages" / "attnquant-cli" / "src" / "attnquant_cli" / "data" / "demo_heldout.jsonl"
)
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def imported(name: str, template: Path | None) -> Path:
    """The imported checkpoint of ``name`` under the bench cache (imported once)."""
    gguf = real_models.gguf_path(name)
    out = real_models.cache() / "check_serve" / f"{gguf.stem}-hf"
    if not (out / "config.json").is_file():
        argv = ["attnquant", "import", str(gguf), "-o", str(out), "--overwrite"]
        if template is not None:
            argv += ["--chat-template", str(template)]
        subprocess.run(argv, check=True)
    return out


class Reference:
    """attnquant-core's numpy float32 forward of ``ckpt``: the checkpoint and its head (the
    262,144-row table for Gemma 3) opened once for every call."""

    def __init__(self, ckpt: Path) -> None:
        self.source = open_source(ckpt)
        self.head = output_head(self.source)

    def logprobs(self, ids: list[int]) -> np.ndarray:
        """``log p`` over the vocabulary at every position of ``ids``."""
        h = final_hidden(self.source, np.asarray([ids], dtype=np.int64))[0]
        return log_softmax((h @ self.head.T).astype(np.float64), axis=-1)

    def greedy(self, ids: list[int], steps: int) -> list[int]:
        """The greedy continuation of ``ids`` (a full forward per step)."""
        out = list(ids)
        for _ in range(steps):
            out.append(int(np.argmax(self.logprobs(out)[-1])))
        return out[len(ids) :]


def check(ckpt: Path, url: str, tokens: int, echo_tokens: int) -> dict:
    """Every request of the module docstring, against the running server at ``url``."""
    import openai
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    from tokenizers import Tokenizer

    client = openai.OpenAI(base_url=url, api_key="unused", timeout=1800, max_retries=0)
    model = client.models.list().data[0].id
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    result: dict = {"model": model}

    raw = client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=tokens, temperature=0
    )
    done = Completion.model_validate(json.loads(raw.text))
    prompt_ids = tok.encode(PROMPT).ids
    reference = Reference(ckpt)
    expected = reference.greedy(prompt_ids, tokens)
    got = tok.encode(done.choices[0].text, add_special_tokens=False).ids
    result["completion"] = {
        "prompt_ids": prompt_ids,
        "text": done.choices[0].text,
        "reference_text": tok.decode(expected),
        "same_text": done.choices[0].text == tok.decode(expected),
        "same_tokens": got == expected,
        "logprobs_when_not_asked": done.choices[0].logprobs,
    }
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=tokens, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    result["completion"]["stream_same_text"] = streamed == done.choices[0].text

    messages = [{"role": "user", "content": QUESTION}]
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=tokens, temperature=0
    )
    chat = ChatCompletion.model_validate(json.loads(raw.text))
    result["chat"] = {
        "content": chat.choices[0].message.content,
        "prompt_tokens": chat.usage.prompt_tokens if chat.usage else None,
        "finish_reason": chat.choices[0].finish_reason,
        "logprobs_when_not_asked": chat.choices[0].logprobs,
    }

    document = read_texts([HELDOUT])[0]
    ids = tok.encode(document).ids[:echo_tokens]
    t0 = time.perf_counter()
    raw = client.completions.with_raw_response.create(
        model=model, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    echo_s = time.perf_counter() - t0
    # The first prompt token has no log-probability: null, as OpenAI's API returns it, which
    # the openai package's types do not admit; read as JSON.
    echo = json.loads(raw.text)["choices"][0]["logprobs"]
    assert echo["token_logprobs"][0] is None and echo["top_logprobs"][0] is None
    served = np.asarray(echo["token_logprobs"][1:], dtype=np.float64)
    ref = reference.logprobs(ids)
    expected_lp = ref[np.arange(len(ids) - 1), ids[1:]]
    served_top = [max(d, key=d.get) for d in echo["top_logprobs"][1:]]
    ref_top = [tok.decode([int(i)]) for i in ref[:-1].argmax(axis=-1)]  # as the server spells
    delta = np.abs(served - expected_lp)
    result["echo"] = {
        "tokens": len(ids),
        "seconds": round(echo_s, 2),
        "max_abs_dlogp": float(delta.max()),
        "median_abs_dlogp": float(np.median(delta)),
        "top1_agreement": float(
            np.mean([a == b for a, b in zip(served_top, ref_top, strict=True)])
        ),
        "served_ppl": float(np.exp(-served.mean())),
        "reference_ppl": float(np.exp(-expected_lp.mean())),
        "tokens_filled": len(echo["tokens"] or []) == len(ids),
        "text_offset_filled": len(echo["text_offset"] or []) == len(ids),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF path, or one of " + ", ".join(real_models.MODELS))
    parser.add_argument("--chat-template", type=Path, help="for a GGUF that carries none")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=16, help="completion length")
    parser.add_argument("--echo-tokens", type=int, default=600, help="echo prompt length")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ckpt = imported(args.model, args.chat_template)
    port = _free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"check_serve-{port}.log"
    argv = ["attnquant", "serve", str(ckpt), "--port", str(port)]
    argv += ["--max-length", str(args.max_length), "--max-log", str(log)]
    t0 = time.perf_counter()
    with open(log.with_suffix(".out"), "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", log)
        ready_s = time.perf_counter() - t0
        printed = len(log.with_suffix(".out").read_text().splitlines())
        result = {
            "checkpoint": str(ckpt),
            "ready_s": round(ready_s, 1),
            "lines_before_ready": printed,
        }
        result |= check(ckpt, f"http://127.0.0.1:{port}/v1", args.tokens, args.echo_tokens)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
