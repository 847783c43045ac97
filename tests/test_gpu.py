"""GPU checks (issues 6 and 7): the kernels' GPU variant and NVFP4 serving, on an accelerator.

Every test here is marked ``gpu`` and skipped, with the reason, where MAX sees no accelerator
(``max.driver.accelerator_count() == 0``). Run them with ``pytest tests/test_gpu.py -m gpu``
(the ``gpu`` nox session) or through ``scripts/gpu_check.sh`` on a lent GPU machine.

* ``generated_linear`` / ``generated_mlp`` placed on ``DeviceRef.GPU()`` (so MAX compiles their
  GPU variant) against the numpy identity ``y = s*(x @ W0.T) + (x @ V) @ U.T`` in float64:
  float32 within 1e-4 and bfloat16 inputs within 2e-2, relative to the output's largest entry,
  ranks 0/16/64, batches 1/16/64 and a few projection-sized shapes. Two compiled graphs in all
  (every dimension symbolic), as in ``packages/attnquant-kernels/tests/test_ops.py``; both build
  and check them with ``attnquant_kernels.testing`` (``device="gpu"`` here). Rank 0 is
  checked through the wrappers' ``U = V = None`` form, which makes the zero-size tensors inside
  the graph, so no zero-byte buffer is ever copied to the device.
* The demo model served with ``ATTNQUANT_QUANT=nvfp4`` (the emulated path: packed weights
  dequantized in the graph) against the unquantized model on ``devices="gpu"``: logit parity and
  the weights held. ``quantization_encoding="float32"`` first, ``"bfloat16"`` when that fails.

With ``AQ_GPU_REPORT_DIR`` set, the measured errors and the parity numbers are also written there
as JSON (``kernels_gpu_errors.json``, ``nvfp4_parity_gpu.json``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnquant_kernels.testing import OpModel, build_linear, build_mlp, check_linear, check_mlp
from attnquant_kernels.testing import theta as random_theta

_driver = pytest.importorskip("max.driver")

ACCELERATORS = _driver.accelerator_count()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        ACCELERATORS == 0,
        reason=(
            "no accelerator: max.driver.accelerator_count() == 0 "
            f"(accelerator_api() is {_driver.accelerator_api()!r}); "
            "run on a GPU machine with scripts/gpu_check.sh"
        ),
    ),
]

REPORT_DIR = os.environ.get("AQ_GPU_REPORT_DIR")
#: Every kernel check's measured error, rewritten to ``kernels_gpu_errors.json`` as it grows.
_KERNEL_REPORT: dict[str, Any] = {"device": None, "checks": []}


def _write_report(name: str, payload: Any) -> None:
    if REPORT_DIR:
        path = Path(REPORT_DIR) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")


def _device_info() -> dict[str, Any]:
    from max.driver import Accelerator, accelerator_api, accelerator_architecture_name

    info: dict[str, Any] = {"api": accelerator_api(), "count": ACCELERATORS}
    try:
        info["architecture"] = accelerator_architecture_name()
        info["label"] = str(Accelerator().label)
    except Exception as exc:  # informative only
        info["error"] = repr(exc)
    return info


# ---------------------------------------------------------------- compiled graphs on the GPU
# Graphs, references and checks: attnquant_kernels.testing (shared with test_ops.py on the CPU).


@pytest.fixture(scope="module")
def gpu() -> None:
    """Records the device in the kernel report before the first graph is compiled on it."""
    _KERNEL_REPORT["device"] = _device_info()


@pytest.fixture(scope="module")
def linear(gpu: None) -> OpModel:
    """Outputs: the op (float32), the rank-0 wrapper form, the op on bfloat16 inputs."""
    return build_linear("gpu")


@pytest.fixture(scope="module")
def mlp(gpu: None) -> OpModel:
    """Outputs: SiLU, tanh-GELU, SiLU in the rank-0 form (float32), SiLU on bfloat16 inputs."""
    return build_mlp("gpu")


def _record(what: str, err: float, bound: float) -> None:
    """Every check's measured error, rewritten to ``kernels_gpu_errors.json`` as it grows."""
    _KERNEL_REPORT["checks"].append({"check": what, "max_rel_error": err, "bound": bound})
    _write_report("kernels_gpu_errors.json", _KERNEL_REPORT)


# ---------------------------------------------------------------- generated_linear


@pytest.mark.parametrize("rank", [0, 16, 64])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_gpu_linear_matches_the_identity(linear: OpModel, rank: int, batch: int):
    check_linear(linear, batch, 96, 72, rank, seed=rank * 100 + batch, report=_record)


@pytest.mark.parametrize(
    ("M", "K", "N", "R"),
    [
        (1, 1, 1, 0),  # smallest
        (5, 257, 33, 17),  # K and r not multiples of anything, N odd
        (1, 1024, 4096, 16),  # decode, MLP-sized output
        (16, 1024, 1024, 64),  # a real projection, a small batch
        (64, 4096, 1024, 64),  # the down projection's width, long float32 sums
    ],
)
def test_gpu_linear_shapes(linear: OpModel, M: int, K: int, N: int, R: int):
    check_linear(linear, M, K, N, R, report=_record)


# ---------------------------------------------------------------- generated_mlp


@pytest.mark.parametrize("rank", [0, 16, 64])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_gpu_mlp_matches_silu_and_gelu_references(mlp: OpModel, rank: int, batch: int):
    check_mlp(mlp, batch, 64, 160, (rank, rank, rank), seed=rank * 100 + batch, report=_record)


@pytest.mark.parametrize(
    ("M", "H", "F", "ranks"),
    [
        (3, 33, 70, (1, 7, 16)),  # a different rank per projection
        (1, 1024, 4096, (16, 16, 16)),  # decode, the benchmark's layer
        (64, 1024, 4096, (64, 5, 16)),
    ],
)
def test_gpu_mlp_shapes(mlp: OpModel, M: int, H: int, F: int, ranks: tuple[int, int, int]):
    check_mlp(mlp, M, H, F, ranks, report=_record)


def test_gpu_linear_kernel_refuses_rank_65(linear: OpModel):
    """A symbolic rank reaches the GPU kernel's host code, which refuses it with the advice.

    Last of the kernel tests, after every check that needs the device in a good state.
    """
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    W0, s, U, V = random_theta(rng, 4, 8, 65)
    with pytest.raises(Exception, match=r"r=65 is above 64.*ATTNQUANT_GEMM=1"):
        linear(x, W0, s, U, V)


# ---------------------------------------------------------------- NVFP4 on the GPU (issue 7)


def _projection_elements(model_dir: Path) -> tuple[int, int]:
    """(elements of every decoder projection, number of projections), from ``config.json``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * head_dim
    kv = cfg["num_key_value_heads"] * head_dim
    ffl = cfg["intermediate_size"]
    per_layer = q * hidden + 2 * kv * hidden + hidden * q + 3 * ffl * hidden
    return layers * per_layer, layers * 7


class _Lines(logging.Handler):
    """Keeps the messages of the records it sees."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def nvfp4_parity(demo: Path) -> dict[str, Any]:
    """``logit_parity`` of the demo under ``ATTNQUANT_QUANT=nvfp4`` on the GPU (one run)."""
    from attnquant_cli._prompts import VERIFY_PROMPTS
    from attnquant_max import logit_parity

    attempts: list[dict[str, Any]] = []
    result: dict[str, Any] = {"model": str(demo), "devices": "gpu", "device": _device_info()}
    handler = _Lines()
    log = logging.getLogger("attnquant_max")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    with contextlib.ExitStack() as undo, pytest.MonkeyPatch.context() as mp:
        undo.callback(log.removeHandler, handler)
        undo.callback(log.setLevel, level)
        mp.setenv("ATTNQUANT_QUANT", "nvfp4")
        for encoding in ("float32", "bfloat16"):
            try:
                report = logit_parity(
                    demo,
                    demo,
                    list(VERIFY_PROMPTS),
                    32,
                    max_length=512,
                    max_batch_size=8,
                    devices="gpu",
                    quantization_encoding=encoding,
                )
            except Exception as exc:
                attempts.append(
                    {"quantization_encoding": encoding, "error": traceback.format_exc()[-4000:]}
                )
                if encoding == "bfloat16":
                    result["attempts"] = attempts
                    _write_report("nvfp4_parity_gpu.json", result)
                    raise AssertionError(
                        f"NVFP4 parity ran with neither float32 nor bfloat16 on the GPU: {exc}"
                    ) from exc
                continue
            attempts.append({"quantization_encoding": encoding, "ok": True})
            result.update(quantization_encoding=encoding, report=dataclasses.asdict(report))
            break
    elements, projections = _projection_elements(demo)
    packed = elements // 2 + elements // 16 + 4 * projections
    report = result["report"]
    saved = None
    if report["base_weight_bytes"] and report["theta_weight_bytes"]:
        saved = report["base_weight_bytes"] - report["theta_weight_bytes"]
    result.update(
        attempts=attempts,
        log=handler.lines,
        projection_elements=elements,
        nvfp4_projection_bytes=packed,
        weight_bytes_saved=saved,
        # What each served projection element took before quantization (4: float32, 2: bf16).
        base_bytes_per_projection_element=None if saved is None else (saved + packed) / elements,
    )
    _write_report("nvfp4_parity_gpu.json", result)
    return result


def test_gpu_nvfp4_parity_reports_real_numbers(nvfp4_parity: dict[str, Any]):
    """The quantized path ran on the GPU and gave finite, non-zero differences."""
    report = nvfp4_parity["report"]
    delta = report["max_abs_logprob_delta"]
    assert math.isfinite(delta), report
    assert 0.0 < delta < float("inf"), report  # the quantized weights really served
    assert 0.0 <= report["agreement"] <= 1.0, report
    assert report["num_prompts"] == 8, report
    assert report["num_tokens"] == 8 * 32, report
    assert report["native_equivalent"] == (delta < 1.0 and report["agreement"] >= 0.9)


def test_gpu_nvfp4_weight_bytes(nvfp4_parity: dict[str, Any]):
    """Each projection: its served dtype's bytes -> 0.5 B code + 1/16 B scale + 4 B per tensor.

    The formula of tests/test_serve_e2e.py::test_verify_nvfp4_reports_real_numbers, with the
    served element size: 4 bytes (float32) or 2 (MAX on a GPU may serve a float32 checkpoint in
    bfloat16); everything else the two models hold is the same.
    """
    report = nvfp4_parity["report"]
    assert report["base_weight_bytes"], report
    assert report["theta_weight_bytes"], report
    elements, packed = nvfp4_parity["projection_elements"], nvfp4_parity["nvfp4_projection_bytes"]
    saved = report["base_weight_bytes"] - report["theta_weight_bytes"]
    assert saved in (4 * elements - packed, 2 * elements - packed), nvfp4_parity
    if nvfp4_parity["quantization_encoding"] == "bfloat16":
        assert saved == 2 * elements - packed, nvfp4_parity


def test_gpu_nvfp4_logs_the_emulated_path(nvfp4_parity: dict[str, Any]):
    """The start-up log says the weights are dequantized in the graph (no FP4 matmul on H200)."""
    assert any("dequantized inside the graph" in line for line in nvfp4_parity["log"]), (
        nvfp4_parity["log"]
    )
