"""GPU checks (issues 6, 7, 17): the kernels' GPU variant, NVFP4 serving and Gemma 3, on a GPU.

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
* ``generated_linear_nvfp4`` (issue 15) placed on the GPU, the same way: packed NVFP4 weight,
  ``s`` and the rank-``r`` correction against the float64 identity over the numpy-dequantized
  weight (float32 within 1e-4, bfloat16 inputs within 2e-2), one graph; in the same graph
  ``nvfp4_dequantize`` (the float weight a long prefill multiplies by), bit for bit the numpy
  one, and transposed in bfloat16.
* The demo model served with ``ATTNQUANT_QUANT=nvfp4`` (the emulated path: packed weights
  dequantized in the graph) against the unquantized model on ``devices="gpu"``: logit parity and
  the weights held. ``quantization_encoding="float32"`` first, ``"bfloat16"`` when that fails.
  Beside it, ``--quant-embedding``'s lookup (``gather_nvfp4_rows``) on the GPU against the numpy
  rows, bit for bit (``nvfp4_embedding_gpu.json``).

* A tiny Gemma 3 in bfloat16 (issue 17): MAX's stock ``Gemma3ForCausalLM`` on the dense
  checkpoint, then attnquant's own Gemma 3 architecture (issue 53) on the dense checkpoint
  (against MAX's: bf16 round-off), on the passthrough theta checkpoint (the same log-probs as
  attnquant's on the dense one) and on G=1 r=16 (max |logprob delta|, agreement), batch-1 tok/s
  of each, and MAX's log-probs against the numpy Gemma 3 reference.
  Its CPU side (:func:`prepare_gemma`, :func:`gemma_reference_scores`) is exercised by
  ``tests/test_gemma_cli.py`` on every run.

With ``AQ_GPU_REPORT_DIR`` set, the measured errors and the parity numbers are also written there
as JSON (``kernels_gpu_errors.json``, ``nvfp4_parity_gpu.json``, ``gemma3_gpu.json``).
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

from attnquant_kernels.testing import (
    OpModel,
    build_linear,
    build_linear_nvfp4,
    build_lowrank,
    build_mlp,
    check_linear,
    check_linear_nvfp4,
    check_lowrank,
    check_mlp,
)
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
def linear_nvfp4(gpu: None) -> OpModel:
    """Outputs: the fused NVFP4 op with s, U, V (float32), its plain form (s = U = V = None), the op
    on bfloat16 inputs; packed E2M1 codes and E4M3 scale bytes as uint8, every dimension symbolic."""
    return build_linear_nvfp4("gpu")


@pytest.fixture(scope="module")
def lowrank(gpu: None) -> OpModel:
    """Outputs: generated_lowrank (float32), the op on bfloat16 inputs."""
    return build_lowrank("gpu")


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


# ---------------------------------------------------------------- generated_linear_nvfp4 (issue 15)
# The GPU variant (one thread per output, codes decoded in registers) has been built for sm_90 in
# the kernels' tests but never run; these run it against the float64 identity over the
# numpy-dequantized weight, as packages/attnquant-kernels/tests/test_ops_nvfp4.py does on the CPU.


@pytest.mark.parametrize("rank", [0, 16, 64])
@pytest.mark.parametrize("batch", [1, 16])
def test_gpu_linear_nvfp4_matches_the_identity(linear_nvfp4: OpModel, rank: int, batch: int):
    check_linear_nvfp4(linear_nvfp4, batch, 96, 72, rank, seed=rank * 100 + batch, report=_record)


@pytest.mark.parametrize(
    ("M", "K", "N", "R"),
    [
        (1, 16, 1, 0),  # one block
        (1, 2048, 2048, 16),  # decode, a 1B model's q_proj
        (1, 2048, 8192, 16),  # decode, its gate/up projection
        (16, 8192, 2048, 64),  # a small batch through down_proj: long float32 sums
    ],
)
def test_gpu_linear_nvfp4_shapes(linear_nvfp4: OpModel, M: int, K: int, N: int, R: int):
    check_linear_nvfp4(linear_nvfp4, M, K, N, R, report=_record)


# ---------------------------------------------------------------- generated_lowrank (issue 15)
# The forms without W0 on the custom-op path; built for sm_90 in the kernels' tests, never run.


@pytest.mark.parametrize(
    ("M", "K", "N", "R"),
    [
        (1, 7, 3, 2),
        (1, 1024, 1024, 256),  # decode, a budget-0.5 rank of a square projection
        (16, 1024, 4096, 409),
        (64, 4096, 1024, 130),  # the down projection's width, long float32 sums
    ],
)
def test_gpu_lowrank_shapes(lowrank: OpModel, M: int, K: int, N: int, R: int):
    check_lowrank(lowrank, M, K, N, R, report=_record)


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


def test_gpu_nvfp4_embedding_rows_are_the_reference_rows():
    """``--quant-embedding`` on the GPU: an NVFP4 table's rows gathered packed and decoded in
    the graph (row-major: the tiled layout is the CPU's) equal the numpy reference's rows, bit
    for bit; 40 rows in a shuffled order with repeats, one graph."""
    from max.driver import CPU, Accelerator, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType

    from attnquant_core.forms import dequantize_nvfp4, quantize_nvfp4
    from attnquant_max._nvfp4_graph import gather_nvfp4_rows

    rng = np.random.default_rng(7)
    q = quantize_nvfp4(rng.standard_normal((40, 64)).astype(np.float32))
    ids = rng.permutation(np.r_[np.arange(40), [39, 0, 17]]).astype(np.uint32)
    arrays = [ids, q.weight, q.weight_scale.view(np.uint8), q.weight_scale_2.reshape(1)]
    dev = DeviceRef.GPU()
    types = [TensorType(DType.from_numpy(a.dtype), list(a.shape), device=dev) for a in arrays]
    with Graph("aq_gpu_nvfp4_gather_40x64", input_types=types) as g:
        i, w, ws, ws2 = (v.tensor for v in g.inputs)
        g.output(gather_nvfp4_rows(w, ws, ws2, i, DType.float32))
    gpu = Accelerator()
    model = InferenceSession(devices=[gpu]).load(g)
    (out,) = model.execute(*(Buffer.from_numpy(a).to(gpu) for a in arrays))
    got = out.to(CPU()).to_numpy()
    want = dequantize_nvfp4(q)[ids]
    _write_report(
        "nvfp4_embedding_gpu.json",
        {
            "device": _device_info(),
            "rows": len(ids),
            "max_abs_diff": float(np.abs(got - want).max()),
        },
    )
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- Gemma 3 in bfloat16 (issue 17)

#: The GPU stage's tiny Gemma 3: head_dim 128 (a size every MAX attention kernel takes), two
#: sliding layers (window 16, shorter than prompt + continuation) and two global ones.
GEMMA_SIZES: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "query_pre_attn_scalar": 128,
    "sliding_window": 16,
    "max_position_embeddings": 256,
}
GEMMA_SERVING: dict[str, int] = {"max_length": 96, "max_batch_size": 4}
#: Token-id prompts (no chat template, no tokenizer in the way), each 12 tokens.
GEMMA_PROMPTS = [[256, *range(3 + 7 * i, 3 + 7 * i + 11)] for i in range(4)]
GEMMA_NEW_TOKENS = 32


def prepare_gemma(root: Path) -> dict[str, Path]:
    """The CPU side of the Gemma stage: the bf16 checkpoint and its two theta checkpoints.

    ``dense`` (with a byte-level tokenizer), ``passthrough`` (G = L, r = 0: must serve the
    identical tokens) and ``g1r16`` (one shared block per family, rank 16). Needs no GPU.
    """
    from attnquant_core import decompose_checkpoint
    from attnquant_core.tiny_gemma import write_tiny_gemma3

    dense = write_tiny_gemma3(root / "gemma3-dense", tokenizer=True, **GEMMA_SIZES)
    paths = {
        "dense": dense,
        "passthrough": root / "gemma3-passthrough",
        "g1r16": root / "gemma3-g1r16",
    }
    decompose_checkpoint(dense, paths["passthrough"], blocks="layers", rank=0, overwrite=True)
    decompose_checkpoint(dense, paths["g1r16"], blocks=1, rank=16, overwrite=True)
    return paths


def gemma_reference_scores(dense: Path, continuations: list[list[int]]) -> list[np.ndarray]:
    """Teacher-forced log-probabilities of each prompt's continuation under the numpy Gemma 3
    reference (float32, the bf16 weights as stored): an independent check of MAX's model."""
    from attnquant_core import open_checkpoint
    from attnquant_core.gemma_reference import gemma3_logits

    ckpt = open_checkpoint(dense)
    state = {key: ckpt.get(key) for key in ckpt.keys()}
    config = json.loads((dense / "config.json").read_text())
    out = []
    for prompt, cont in zip(GEMMA_PROMPTS, continuations, strict=True):
        ids = prompt + cont
        logits = gemma3_logits(config, state, ids, dtype=np.float32).astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        out.append(logp[len(prompt) - 1 : len(ids) - 1][np.arange(len(cont)), cont])
    return out


def _tokens_per_second(model: Any, repetitions: int = 3) -> float:
    """Batch-1 greedy decode rate, median of ``repetitions`` (after one warm-up)."""
    import statistics
    import time

    from attnquant_max import greedy_generate

    greedy_generate(model, GEMMA_PROMPTS[0], 8)
    rates = []
    for _ in range(repetitions):
        start = time.perf_counter()
        greedy_generate(model, GEMMA_PROMPTS[0], GEMMA_NEW_TOKENS)
        rates.append(GEMMA_NEW_TOKENS / (time.perf_counter() - start))
    return statistics.median(rates)


@pytest.fixture(scope="module")
def gemma_gpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tiny Gemma 3 in bfloat16 on the GPU: MAX's stock architecture on the dense checkpoint,
    then ours on the passthrough and G=1 r=16 theta checkpoints, one model loaded at a time."""
    from max.pipelines import AutoModel, AutoTokenizer
    from max.pipelines.architectures.gemma3 import gemma3_arch

    from attnquant_max import (
        LoadedModel,
        ParityReport,
        ServingOptions,
        greedy_generate,
        greedy_logprobs,
        load_pipeline,
    )

    paths = prepare_gemma(tmp_path_factory.mktemp("gemma-gpu"))
    result: dict[str, Any] = {
        "device": _device_info(),
        "sizes": GEMMA_SIZES,
        "serving": GEMMA_SERVING,
        "prompts": len(GEMMA_PROMPTS),
        "new_tokens": GEMMA_NEW_TOKENS,
        # Gemma3ForCausalLM does not support device-graph capture in MAX 26.7: off for both.
        "device_graph_capture": bool(gemma3_arch.supports_device_graph_capture),
    }
    try:
        stock_model = AutoModel(str(paths["dense"]), devices="gpu", **GEMMA_SERVING)
        with LoadedModel(
            path=paths["dense"],
            model=stock_model,
            tokenizer=AutoTokenizer(str(paths["dense"])),
            **GEMMA_SERVING,
        ) as stock:
            tokens = [greedy_generate(stock, p, GEMMA_NEW_TOKENS) for p in GEMMA_PROMPTS]
            base = [
                greedy_logprobs(stock, p, c) for p, c in zip(GEMMA_PROMPTS, tokens, strict=True)
            ]
            result["stock_tok_s"] = _tokens_per_second(stock)
        result["stock_tokens"] = tokens
        reference = gemma_reference_scores(paths["dense"], tokens)
        result["stock_vs_numpy_reference_max_abs_logprob_delta"] = float(
            max(np.abs(b.logprobs - r).max() for b, r in zip(base, reference, strict=True))
        )
        ours_base = base
        for name in ("dense", "passthrough", "g1r16"):
            with load_pipeline(
                paths[name],
                devices="gpu",
                options=ServingOptions(path="precompute-outside"),
                **GEMMA_SERVING,
            ) as theta:
                scores = [
                    greedy_logprobs(theta, p, c) for p, c in zip(GEMMA_PROMPTS, tokens, strict=True)
                ]
                # attnquant's own Gemma 3 architecture on the dense checkpoint against MAX's
                # stock one; the theta checkpoints against attnquant's on the dense one.
                report = ParityReport.from_scores(ours_base, scores, tokens)
                if name == "dense":
                    ours_base = scores
                result[name] = dataclasses.asdict(report)
                if name == "passthrough":
                    result[name]["tokens"] = [
                        greedy_generate(theta, p, GEMMA_NEW_TOKENS) for p in GEMMA_PROMPTS
                    ]
                result[name]["tok_s"] = _tokens_per_second(theta)
    except Exception:
        result["error"] = traceback.format_exc()[-6000:]
        _write_report("gemma3_gpu.json", result)
        raise
    _write_report("gemma3_gpu.json", result)
    return result


def test_gpu_gemma3_passthrough_serves_identical_tokens(gemma_gpu: dict[str, Any]):
    """The theta checkpoint at passthrough is the dense model: the same log-probs as attnquant's
    architecture on the dense checkpoint (the same bf16 weights in the same graph; the bound
    only allows for a non-deterministic GPU reduction, the JSON keeps the exact figure)."""
    assert gemma_gpu["passthrough"]["max_abs_logprob_delta"] <= 1e-5, gemma_gpu
    assert gemma_gpu["passthrough"]["agreement"] == 1.0, gemma_gpu


def test_gpu_gemma3_attnquant_architecture_matches_max_s(gemma_gpu: dict[str, Any]):
    """attnquant's Gemma 3 (Llama's pipeline, Gemma's blocks) against MAX's stock Gemma 3 on the
    same bf16 weights: another graph, so bf16 round-off, not whole nats."""
    assert gemma_gpu["dense"]["max_abs_logprob_delta"] < 0.5, gemma_gpu
    assert gemma_gpu["dense"]["agreement"] >= 0.9, gemma_gpu


def test_gpu_gemma3_g1r16_reports_real_numbers(gemma_gpu: dict[str, Any]):
    """G=1 r=16 is a different model: finite, non-zero differences, agreement in [0, 1]."""
    report = gemma_gpu["g1r16"]
    assert 0.0 < report["max_abs_logprob_delta"] < float("inf"), gemma_gpu
    assert 0.0 <= report["agreement"] <= 1.0, gemma_gpu
    assert report["num_tokens"] == len(GEMMA_PROMPTS) * GEMMA_NEW_TOKENS, gemma_gpu


def test_gpu_gemma3_matches_the_numpy_reference(gemma_gpu: dict[str, Any]):
    """MAX's Gemma 3 in bf16 against the numpy reference in float32 on the same weights: bf16
    activations move log-probabilities by a few 1e-2 on this model, not by whole nats."""
    assert gemma_gpu["stock_vs_numpy_reference_max_abs_logprob_delta"] < 0.5, gemma_gpu


def test_gpu_gemma3_throughput_measured(gemma_gpu: dict[str, Any]):
    assert gemma_gpu["stock_tok_s"] > 0 and gemma_gpu["passthrough"]["tok_s"] > 0, gemma_gpu
    assert gemma_gpu["g1r16"]["tok_s"] > 0, gemma_gpu
