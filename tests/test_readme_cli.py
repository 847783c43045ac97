"""Every line of the README's command-line block runs as written.

The block is a synopsis: its placeholders are filled here (``CKPT`` and ``BASE`` are a tiny
byte-level Llama whose widths fit every 4-bit form, so that the whole block runs in seconds:
on the demo model it took 4-10 minutes on two cores; ``MODEL.gguf`` is that model written as a
GGUF, ``PATH`` the start of a shipped text sample (two windows of 512 bytes), ``OUT`` and ``STATS`` files of this test,
``THETA...`` the first checkpoint written). An optional ``[...]`` is given (but a flag that
needs MAX's forward), and of ``a|b|c`` the one that runs without MAX. The lines that serve
through MAX (``serve``, ``generate``, ``verify``, ``bench``) are the served tests'.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from attnquant_cli import cli
from attnquant_core.io import export_gguf
from attnquant_core.testing import write_byte_llama

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "packages/attnquant-cli/src/attnquant_cli/data/demo_calibration.jsonl"
#: The tiny model's projections: every in-width a multiple of 16 (an NVFP4 block) and every
#: matrix at least 32 on each side (the block's ``--rank 0,8,32``).
SHAPES = {
    "self_attn.q_proj": (64, 64),
    "self_attn.k_proj": (32, 64),
    "self_attn.v_proj": (32, 64),
    "self_attn.o_proj": (64, 64),
    "mlp.gate_proj": (96, 64),
    "mlp.up_proj": (96, 64),
    "mlp.down_proj": (64, 96),
}
THROUGH_MAX = {"serve", "generate", "verify", "bench"}
#: Of ``a|b|c`` alternatives, the one this test runs (MAX's forward is the served tests').
CHOICES = {"G|layers": "layers", "auto|max|numpy": "numpy"}
#: Optional flags that need MAX's forward (left out beside ``--forward numpy``).
NEEDS_MAX = {"[--decode-steps]"}


def readme_cli_lines() -> list[str]:
    """The ``attnquant ...`` lines of the README's command-line block, comments removed."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## The command line", 1)[1].split("\n\n", 2)[1]
    lines = [re.split(r"\s{2,}#", line.strip(), maxsplit=1)[0] for line in block.splitlines()]
    return [line.strip() for line in lines if line.strip().startswith("attnquant ")]


def fill(
    line: str, where: Path, theta: Path | None, gguf: Path, data: Path, model: Path
) -> list[str]:
    """``line``'s argv with the placeholders filled (see the module docstring)."""
    argv: list[str] = []
    tokens = shlex.split(line)[1:]
    for i, token in enumerate(tokens):
        if token in NEEDS_MAX:
            continue
        token = CHOICES.get(token.strip("[]"), token).strip("[]")
        after = tokens[i - 1] if i else ""
        if token in ("...", ""):
            continue
        if token == "MODEL.gguf":
            token = str(gguf)
        elif after == "-o":
            stats = where.parent / "stats.safetensors"
            token = str(stats if token == "STATS" else where / f"{token}-{i}")
        elif token in ("CKPT", "BASE"):
            token = str(model)
        elif token in ("THETA", "THETA..."):
            assert theta is not None, f"{line!r}: no checkpoint written before it"
            token = str(theta)
        elif token == "PATH":
            token = str(data)
        elif token == "STATS":
            token = str(where.parent / "stats.safetensors")
        elif token == "R":
            token = "8"
        argv.append(token)
    return argv


def test_every_readme_cli_line_runs_as_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # `analyze` writes its report beside the working directory
    lines = readme_cli_lines()
    assert len(lines) >= 15, lines  # the block was found
    model = tmp_path / "tiny"
    write_byte_llama(model, 3, shapes=SHAPES, max_positions=512)
    gguf = export_gguf(model, tmp_path / "tiny.gguf")
    first = json.loads(SAMPLE.read_text().splitlines()[0])
    data = tmp_path / "sample.jsonl"
    data.write_text(json.dumps({"text": first["text"][:1100]}) + "\n")
    theta, ran = None, []
    for n, line in enumerate(lines):
        argv = fill(line, tmp_path / f"line{n}", theta, gguf, data, model)
        if argv[0] in THROUGH_MAX:
            continue
        (tmp_path / f"line{n}").mkdir()
        if argv[0] == "calibrate" and any("--allocation sensitivity" in later for later in lines):
            argv.append("--sensitivity")  # as the sensitivity line's comment asks, first
        assert cli(argv) == 0, f"README line failed: {line}\nran as: attnquant {shlex.join(argv)}"
        if argv[0] == "decompose" and theta is None:
            theta = Path(argv[argv.index("-o") + 1])
        ran.append(argv[0])
    assert {"import", "decompose", "calibrate", "eval", "analyze", "export", "check"} <= set(ran)
