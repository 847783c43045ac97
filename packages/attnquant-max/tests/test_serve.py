"""The max serve command line and its environment."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from attnquant_max import (
    ConfigError,
    ServingOptions,
    architectures_path,
    max_entrypoint,
    serve_command,
    serve_env,
)


def test_architectures_folder_is_an_importable_module() -> None:
    folder = architectures_path()
    assert folder.is_dir()
    assert (folder / "__init__.py").is_file()
    assert "ARCHITECTURES" in (folder / "__init__.py").read_text()


def test_entrypoint_is_this_environment() -> None:
    argv = max_entrypoint()
    assert argv[0] == sys.executable or Path(argv[0]).parent == Path(sys.executable).parent


def test_serve_command_on_cpu(tmp_path: Path) -> None:
    argv = serve_command(tmp_path, port=8123)
    assert argv[len(max_entrypoint())] == "serve"
    flags = dict(itertools.pairwise(argv))
    assert flags["--model-path"] == str(tmp_path)
    assert flags["--custom-architectures"] == str(architectures_path())
    assert flags["--devices"] == "cpu"
    assert flags["--quantization-encoding"] == "float32"
    assert flags["--host"] == "127.0.0.1"
    assert flags["--port"] == "8123"
    assert "--max-length" not in argv


def test_serve_command_options(tmp_path: Path) -> None:
    argv = serve_command(
        tmp_path,
        port=1,
        host="0.0.0.0",
        devices="gpu",
        max_length=128,
        max_batch_size=2,
        served_model_name="demo",
        extra_args=["--foo"],
    )
    assert "--quantization-encoding" not in argv  # MAX picks on GPU
    assert argv[-1] == "--foo"
    for pair in (["--max-length", "128"], ["--max-batch-size", "2"], ["--host", "0.0.0.0"]):
        i = argv.index(pair[0])
        assert argv[i : i + 2] == pair
    assert argv[argv.index("--served-model-name") + 1] == "demo"


def test_serve_env_is_offline_and_validated() -> None:
    options = ServingOptions(blocks="layers", rank=8)
    env = serve_env(options, {"PATH": "/bin", "ATTNQUANT_GEMM": "1"})
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["MAX_SERVE_DISABLE_TELEMETRY"] == "1"
    assert env["ATTNQUANT_BLOCKS"] == "layers"
    assert env["ATTNQUANT_RANK"] == "8"
    assert env["ATTNQUANT_PATH"] == "auto" and "ATTNQUANT_GEMM" not in env  # the options win
    assert ServingOptions.from_env(env) == options  # what the max serve child reads back
    assert env["MAX_SERVE_LOGS_ENABLE_COMPONENTS"] == "attnquant_max"
    env = serve_env(env={"MAX_SERVE_LOGS_ENABLE_COMPONENTS": "foo"}, offline=False)
    assert env["MAX_SERVE_LOGS_ENABLE_COMPONENTS"] == "foo,attnquant_max"
    assert "HF_HUB_OFFLINE" not in env
    with pytest.raises(ConfigError, match="ATTNQUANT_RANK"):
        serve_env(env={"ATTNQUANT_RANK": "-1"})
    with pytest.raises(NotImplementedError, match="--quant nvfp4"):
        serve_env(env={"ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_PRECOMPUTE": "1"})
    assert serve_env(env={"ATTNQUANT_QUANT": "nvfp4"})["ATTNQUANT_QUANT"] == "nvfp4"
