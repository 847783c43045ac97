"""The command line on a tiny Gemma 3 (bf16, made in numpy): what works on a CPU does, and what
MAX serves on a GPU only (Gemma 4) says so in one line, before MAX is started. No graph is
compiled."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnquant_cli import cli
from attnquant_core import ThetaCheckpoint, open_checkpoint
from attnquant_core.gemma_reference import gemma3_logits
from attnquant_core.tiny_gemma import write_tiny_gemma3, write_tiny_gemma4


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "dense", tokenizer=True)


def _state(path: Path) -> dict[str, np.ndarray]:
    ckpt = open_checkpoint(path)
    return {key: ckpt.get(key) for key in ckpt.keys()}


@pytest.mark.parametrize(
    "args",
    [["--blocks", "layers", "--rank", "0"], ["--blocks", "2", "--rank", "4"], ["--budget", "0.5"]],
    ids=["passthrough", "G2r4", "budget"],
)
def test_decompose_gemma3(gemma3: Path, tmp_path: Path, args: list[str], capsys) -> None:
    out = tmp_path / "theta"
    assert cli(["decompose", str(gemma3), "-o", str(out), *args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["stored_parameters"] > 0
    rebuilt = dict(ThetaCheckpoint.open(out).rebuilt_state())
    source = _state(gemma3)
    assert rebuilt.keys() == source.keys()
    assert all(rebuilt[k].dtype == source[k].dtype for k in source)
    if args[1] == "layers":
        assert all(rebuilt[k].tobytes() == source[k].tobytes() for k in source)
    for side in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (out / side).exists()


def test_decompose_align_at_passthrough_gemma3(gemma3: Path, tmp_path: Path, capsys) -> None:
    """--align at passthrough: aligned (G = 1), then exact; the bf16 round-off is said."""
    out = tmp_path / "theta"
    argv = ["decompose", str(gemma3), "-o", str(out), "--blocks", "layers", "--rank", "0"]
    assert cli([*argv, "--align"]) == 0
    err = capsys.readouterr().err
    assert "round-off" in err
    config = json.loads((gemma3 / "config.json").read_text())
    ids = [5, 17, 200, 3, 99, 42, 7, 250, 1, 64, 128, 31]
    rebuilt = dict(ThetaCheckpoint.open(out).rebuilt_state())
    moved = np.abs(gemma3_logits(config, rebuilt, ids) - gemma3_logits(config, _state(gemma3), ids))
    assert moved.max() < 5e-2


def test_analyze_gemma3(gemma3: Path, tmp_path: Path) -> None:
    out = tmp_path / "analyze"
    argv = ["analyze", str(gemma3), "--blocks", "1,2,layers", "--rank", "0,4", "-o", str(out)]
    assert cli(argv) == 0
    assert (out / "analyze.csv").exists() and (out / "analyze.json").exists()


def test_export_nvfp4_gemma3(gemma3: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "fp4"
    assert cli(["export", str(gemma3), "-o", str(out), "--format", "nvfp4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["quantized"] == 7 * 4  # every projection of the 4 layers
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["quantization_config"]["quant_algo"] == "NVFP4"


@pytest.mark.parametrize("command", ["generate", "verify", "serve"])
def test_gemma4_on_a_cpu_says_it_needs_a_gpu(gemma4_31b: Path, command: str, capsys) -> None:
    """Gemma 4 (MAX's, GPU-only); Gemma 3 text is served on the CPU (tests/test_gemma3_serve.py)."""
    argv = {
        "generate": ["generate", str(gemma4_31b), "--prompt", "hi"],
        "verify": ["verify", str(gemma4_31b), str(gemma4_31b)],
        "serve": ["serve", str(gemma4_31b), "--port", "18931"],
    }[command]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert "Gemma4ForConditionalGeneration needs a GPU in MAX 26.7" in err
    assert "not supported by MAX engine" not in err


def test_gpu_stage_preparation_runs_on_the_cpu(tmp_path: Path) -> None:
    """The CPU side of scripts/gpu_check.sh's Gemma stage (tests/test_gpu.py), kept working here:
    the checkpoints it serves and the numpy reference it compares MAX with."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_gpu_checks", Path(__file__).with_name("test_gpu.py")
    )
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    paths = gpu.prepare_gemma(tmp_path)
    assert ThetaCheckpoint.open(paths["passthrough"]).passthrough
    assert ThetaCheckpoint.open(paths["g1r16"]).rank == 16
    assert (paths["dense"] / "tokenizer.json").exists()
    cont = [[7] * gpu.GEMMA_NEW_TOKENS for _ in gpu.GEMMA_PROMPTS]
    scores = gpu.gemma_reference_scores(paths["dense"], cont)
    assert all(s.shape == (gpu.GEMMA_NEW_TOKENS,) and (s < 0).all() for s in scores)
    ids = max(max(p) for p in gpu.GEMMA_PROMPTS)
    assert ids < json.loads((paths["dense"] / "config.json").read_text())["vocab_size"]


# -- Gemma 4 31B's shape: global layers with their own head size and no v_proj -----------------


@pytest.fixture(scope="module")
def gemma4_31b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma4(tmp_path_factory.mktemp("gemma4") / "dense", tokenizer=True)


@pytest.mark.parametrize(
    "args",
    [
        ["--blocks", "layers", "--rank", "0"],
        ["--blocks", "2", "--rank", "4"],
        ["--blocks", "1", "--rank", "8"],
        ["--budget", "0.5"],
    ],
    ids=["passthrough", "G2r4", "G1r8", "budget"],
)
def test_decompose_gemma4_31b_shape(
    gemma4_31b: Path, tmp_path: Path, args: list[str], capsys
) -> None:
    out = tmp_path / "theta"
    assert cli(["decompose", str(gemma4_31b), "-o", str(out), *args, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["stored_parameters"] > 0
    assert "self_attn.q_proj@full_attention" in summary["families"]
    manifest = json.loads((out / "attnquant.json").read_text())
    assert manifest["format_version"] == 3
    rebuilt = dict(ThetaCheckpoint.open(out).rebuilt_state())
    source = _state(gemma4_31b)
    assert rebuilt.keys() == source.keys()
    assert all(rebuilt[k].dtype == source[k].dtype for k in source)
    if args[1] == "layers":
        assert all(rebuilt[k].tobytes() == source[k].tobytes() for k in source)


def test_decompose_align_gemma4_is_refused_in_one_line(
    gemma4_31b: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "theta"
    argv = ["decompose", str(gemma4_31b), "-o", str(out), "--blocks", "layers", "--rank", "0"]
    assert cli([*argv, "--align"]) != 0
    err = capsys.readouterr().err.strip()
    assert "does not support Gemma 4" in err and "without --align" in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not support Gemma 4" in errors[0]  # one line says why
    assert not out.exists()


def test_analyze_gemma4_31b_shape(gemma4_31b: Path, tmp_path: Path) -> None:
    out = tmp_path / "analyze"
    argv = ["analyze", str(gemma4_31b), "--blocks", "1,2,layers", "--rank", "0,4", "-o", str(out)]
    argv += ["--budget", "0.3,0.6"]  # the auto form's frontier too
    assert cli(argv) == 0
    result = json.loads((out / "analyze.json").read_text())
    assert "self_attn.o_proj@full_attention" in json.dumps(result)


@pytest.mark.parametrize("source", ["dense", "theta"])
def test_export_nvfp4_gemma4_31b_shape(
    gemma4_31b: Path, tmp_path: Path, source: str, capsys
) -> None:
    src = gemma4_31b
    if source == "theta":
        src = tmp_path / "theta"
        assert (
            cli(["decompose", str(gemma4_31b), "-o", str(src), "--blocks", "2", "--rank", "4"]) == 0
        )
        capsys.readouterr()
    out = tmp_path / "fp4"
    assert cli(["export", str(src), "-o", str(out), "--format", "nvfp4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["quantized"] == len(open_checkpoint(gemma4_31b).projection_keys())
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == "NVFP4"
