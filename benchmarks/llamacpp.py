"""llama.cpp beside attnquant: what a CPU user picks instead, built here from a registry's source.

* :func:`build` builds llama.cpp's tools (``llama-bench``, ``llama-quantize``, ``llama-server``,
  ``llama-perplexity``, ``llama-imatrix``) once into a cache, from the llama.cpp tree that
  ``llama-cpp-python``'s sdist carries (PyPI has no llama.cpp binaries for this machine; the
  sdist is a registry package, fetched by ``pip download``, so nothing outside the registries is
  reached). Native CPU flags, Release, no network features. Never run by the default CI.
* :func:`hf_to_gguf` writes a Hugging Face Llama checkpoint (ours: the demo, a trained or a
  synthetic one) as a float32 GGUF with its tokenizer, laid out as llama.cpp's converter lays it
  out (q/k rows permuted to interleaved RoPE), so llama.cpp's own ``llama-quantize`` makes its
  Q4_0 / Q4_K_M / imatrix files from the very weights attnquant compresses.
* :class:`LlamaServer` serves a GGUF with ``llama-server`` (greedy completions of token ids,
  ``ignore_eos``, no prompt cache); :meth:`LlamaCppModel.sample` times one by llama-server's own
  ``timings``, :meth:`LlamaServer.runner` hands the completion to a caller that times it
  (``profile_decode.py``).
* :func:`gguf_state` reads a (quantized) GGUF back into float32 Hugging Face tensors with the
  ``gguf`` package, for the numpy forward's perplexity, agreement and KL on our own tokens.

Cache: ``$ATTNQUANT_BENCH_CACHE`` or ``~/.cache/attnquant-bench``. Build by hand with
``uv run python benchmarks/llamacpp.py build`` (about 40 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _servers import wait_healthy

from attnquant_core.io import gguf_tensor_name, hf_tensor_key, permute_rope

__all__ = [
    "LLAMA_CPP_PYTHON",
    "permute_rope",
    "TOOLS",
    "LlamaCppModel",
    "LlamaServer",
    "build",
    "gguf_state",
    "hf_to_gguf",
    "imatrix",
    "quantize",
    "tool",
]

#: The llama-cpp-python release whose vendored llama.cpp tree is built (its commit is recorded).
LLAMA_CPP_PYTHON = "0.3.36"
TOOLS = (
    "llama-bench",
    "llama-quantize",
    "llama-server",
    "llama-perplexity",
    "llama-imatrix",
    "llama-tokenize",
)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # static: the finished tree is renamed into place
)
#: Added on x86-64: the native build without AMX. Where the CPU reports AMX (a Sapphire Rapids
#: guest, 2026-12-04), ggml's AMX matmul faults in ``ldtilecfg`` on the first Q4_K_M forward
#: (``llama-bench`` and ``llama-server`` die with SIGSEGV in ``ggml_backend_amx_mul_mat``), though
#: a plain ``ldtilecfg`` runs there; batch-1 decode takes the AVX-512 VNNI GEMV either way.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_flags() -> list[str]:
    """The configure flags of this machine's build: :data:`CMAKE_FLAGS`, and AMX off on x86-64."""
    flags = list(CMAKE_FLAGS)
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return flags


def cache_root() -> Path:
    """Where the sdist, the build and the GGUF files of the benchmarks are kept."""
    root = os.environ.get("ATTNQUANT_BENCH_CACHE") or Path.home() / ".cache" / "attnquant-bench"
    return Path(root)


def _home(version: str) -> Path:
    return cache_root() / f"llama.cpp-{version}"


def tool(name: str, version: str = LLAMA_CPP_PYTHON) -> Path:
    """The path of a built llama.cpp tool; exits saying how to build it when absent."""
    path = _home(version) / "build" / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} is not built: uv run python benchmarks/llamacpp.py build")
    return path


def build(version: str = LLAMA_CPP_PYTHON, *, jobs: int | None = None) -> dict[str, Any]:
    """Build llama.cpp's :data:`TOOLS` once (a no-op when ``built.json`` is there, built with
    :func:`cmake_flags`); returns it.

    The sdist comes from ``pip download`` (the registries pip is configured with); the tree is
    unpacked, configured and built under a temporary name and renamed when done, so an
    interrupted build leaves nothing that looks finished.
    """
    home = _home(version)
    marker = home / "built.json"
    flags = cmake_flags()
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("cmake_flags") == flags and set(TOOLS) <= set(info.get("tools", ())):
            return info
        print(f"{home}: built with {info.get('cmake_flags')} ({info.get('tools')}); rebuilding")
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            # A uv venv has no pip module (whatever pip is on PATH): ask uv for one then.
            if subprocess.run(
                [sys.executable, "-m", "pip", "--version"], capture_output=True
            ).returncode:
                pip = ["uv", "run", "--no-project", "--with", "pip", "python", *pip[1:]]
            subprocess.run([*pip, "-d", tmp, f"llama-cpp-python=={version}"], check=True)
            (got,) = Path(tmp).glob("*.tar.gz")
            got.rename(sdist)
    work = Path(tempfile.mkdtemp(prefix=f"{home.name}.tmp-", dir=root))
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = "src/" + m.name.removeprefix(prefix)
        tar.extractall(work, members=members, filter="data")
    src, out = work / "src", work / "build"
    t0 = time.perf_counter()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", src, "-B", out, *generator, *flags], check=True)
    jobs = jobs or os.cpu_count() or 1
    subprocess.run(["cmake", "--build", out, "-j", str(jobs), "--target", *TOOLS], check=True)
    info = {
        "llama_cpp_python": version,
        "llama_cpp_version": _version(out / "bin"),
        "cmake_flags": flags,
        "tools": list(TOOLS),
        "build_s": round(time.perf_counter() - t0),
    }
    (work / "built.json").write_text(json.dumps(info, indent=2) + "\n")
    if home.exists():
        shutil.rmtree(home)
    work.rename(home)
    return info


def _version(bin_dir: Path) -> str:
    """What the built tools say they are (the sdist carries no git history: ``build 0``)."""
    out = subprocess.run([bin_dir / "llama-server", "--version"], capture_output=True, text=True)
    return next((ln for ln in (out.stdout + out.stderr).splitlines() if "ersion" in ln), "?")


# --- GGUF --------------------------------------------------------------------------------------


def gguf_name(key: str) -> str:
    """llama.cpp's tensor name of a Hugging Face Llama key (attnquant-core's mapping)."""
    return gguf_tensor_name(key)


def hf_name(name: str) -> str:
    """The Hugging Face key of a llama.cpp tensor name (:func:`gguf_name` inverted)."""
    return hf_tensor_key(name, "llama")


def _layer_order(key: str) -> tuple[int, str]:
    parts = key.split(".")
    return (int(parts[2]) if parts[1] == "layers" else -1, key)


def hf_to_gguf(checkpoint: Path, out: Path) -> Path:
    """A Hugging Face Llama ``checkpoint`` as a float32 GGUF (:func:`attnquant_core.io.export_gguf`).
    For a checkpoint that ``attnquant import`` made, write its source GGUF back in float32
    instead (:func:`attnquant_core.io.dequantize_gguf`): the same metadata and tokenizer."""
    from attnquant_core.io import export_gguf

    return export_gguf(checkpoint, out)


def gguf_state(path: Path) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A GGUF's tensors dequantized to float32 under Hugging Face keys, and the bytes each holds
    in the file (:func:`attnquant_core.io.gguf_state`)."""
    from attnquant_core.io import gguf_state as read

    state, sizes, _ = read(path)
    return state, sizes


# --- llama.cpp's own tools -----------------------------------------------------------------------


def _run(cmd: list, log: Path) -> None:
    """Run a llama.cpp tool with its output in ``log``; a failure says the tail of the log."""
    with log.open("w") as f:
        done = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{Path(cmd[0]).name} exited {done.returncode} (log {log}):\n{tail}")


def quantize(
    src: Path,
    dst: Path,
    qtype: str,
    *,
    imatrix: Path | None = None,
    threads: int = 2,
    extra: Sequence[str] = (),
) -> Path:
    """``llama-quantize src dst qtype`` (``Q4_0``, ``Q4_K_M``, ...), with an importance matrix
    when given and ``extra`` options (``--output-tensor-type f32``, ...); written under a
    temporary name, renamed when complete; its output (the types chosen, fallbacks) in
    ``dst.log``."""
    tmp = dst.with_name(dst.name + ".tmp")
    cmd = [tool("llama-quantize"), *extra, *(["--imatrix", imatrix] if imatrix else [])]
    _run([*cmd, src, tmp, qtype, str(threads)], dst.with_name(dst.name + ".log"))
    tmp.replace(dst)
    return dst


def cached_gguf(checkpoint: Path, directory: Path, qtype: str) -> Path:
    """``directory/model-<qtype>.gguf`` of ``checkpoint`` (``qtype`` ``F32`` or a
    ``llama-quantize`` type), made once and reused: its float32 GGUF (:func:`hf_to_gguf`), then
    :func:`quantize` on every core."""
    directory.mkdir(parents=True, exist_ok=True)
    f32 = directory / "model-f32.gguf"
    if not f32.exists():
        hf_to_gguf(checkpoint, f32)
    out = directory / f"model-{qtype.lower()}.gguf"
    if not out.exists():
        quantize(f32, out, qtype.upper(), threads=os.cpu_count() or 1)
    return out


def imatrix(
    model: Path,
    text: Path,
    out: Path,
    *,
    threads: int = 2,
    ctx: int = 256,
    chunks: int = 64,
    parse_special: bool = False,
) -> Path:
    """``llama-imatrix`` of ``model`` over the calibration ``text`` (``ctx``-token chunks, the
    first token of each replaced by BOS, as llama-imatrix does); ``parse_special``: special
    tokens written in the text (``<|eos|>``) are read as those tokens. Log in ``out.log``."""
    tmp = out.with_name(out.name + ".tmp.gguf")
    cmd = [tool("llama-imatrix"), "-m", model, "-f", text, "-o", tmp, "-t", str(threads)]
    cmd += ["-c", str(ctx), "--chunks", str(chunks), "--no-ppl"]
    cmd += ["--parse-special"] if parse_special else []
    _run(cmd, out.with_name(out.name + ".log"))
    tmp.replace(out)
    return out


class LlamaServer:
    """``llama-server`` on a GGUF file, on a free loopback port, stopped on :meth:`close`.

    ``parallel`` slots share a context of ``parallel * ctx`` tokens (``-np``, ``-c``): one
    stream per slot, continuous batching as llama-server does it.
    """

    def __init__(
        self,
        model: Path,
        *,
        threads: int = 2,
        ctx: int = 1024,
        parallel: int = 1,
        extra: Sequence[str] = (),
    ) -> None:
        from attnquant_max.gateway import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        cmd = [tool("llama-server"), "-m", model, "--host", "127.0.0.1", "--port", self.port]
        cmd += ["-t", threads, "-tb", threads, "-c", ctx * parallel, "-np", parallel]
        cmd += ["-b", 512, "-ub", 512, "--no-webui", *extra]
        self.command = [str(c) for c in cmd]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.proc, self.url, self.log, timeout_s=300)
        except BaseException:
            self.close()
            raise

    def complete(self, ids: list[int], n: int) -> dict[str, Any]:
        """A greedy completion of the token ids ``ids``: exactly ``n`` new tokens."""
        import httpx

        body = {
            "prompt": ids,
            "n_predict": n,
            "ignore_eos": True,
            "cache_prompt": False,
            "temperature": 0.0,
            "top_k": 1,
            "samplers": ["top_k"],
        }
        r = httpx.post(f"{self.url}/completion", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def runner(self) -> Callable[[list[int], int], Any]:
        """A :data:`attnquant_cli._bench.Runner`: what ``measure`` times."""
        return self.complete

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LlamaCppModel:
    """A GGUF file served by ``llama-server``: what ``bench_compressed`` times beside a MAX model.

    ``weight_bytes`` is what its tensors hold in the file; ``streamed_bytes`` what one batch-1
    decode step reads (every tensor but the embedding table, of which it reads one row, when
    the head is a tensor of its own); ``projection_bytes`` the seven projections' share.
    """

    def __init__(self, gguf: Path, *, threads: int, ctx: int) -> None:
        import gguf as gg

        self.path = gguf
        tensors = {t.name: t for t in gg.GGUFReader(str(gguf)).tensors}
        sizes = {name: int(t.n_bytes) for name, t in tensors.items()}
        self.weight_bytes = sum(sizes.values())
        table, vocab = sizes["token_embd.weight"], int(tensors["token_embd.weight"].shape[1])
        tied = "output.weight" not in sizes
        self.streamed_bytes = self.weight_bytes - (0 if tied else table - table // vocab)
        self.projection_bytes = sum(
            n for k, n in sizes.items() if k.startswith("blk.") and "norm" not in k
        )
        self.types = sorted({t.tensor_type.name for t in tensors.values()})
        self.server = LlamaServer(gguf, threads=threads, ctx=ctx)

    def runner(self) -> Callable[[list[int], int], Any]:
        return self.server.runner()

    def sample(self, prompt: list[int], new_tokens: int) -> Any:
        """One timed run, as ``attnquant_cli._bench.Sample``, from llama-server's own timings of
        one request: two requests timed from outside (one token, then all), as the MAX rows
        are, differ by less than their HTTP and slot latency on a small model, so the decode
        rate that their difference gives is noise there."""
        from attnquant_cli._bench import Sample

        t = self.server.complete(prompt, new_tokens)["timings"]
        if t["cache_n"]:
            raise RuntimeError(f"llama-server reused {t['cache_n']} cached prompt tokens")
        return Sample(
            ttft_s=t["prompt_ms"] / 1e3,  # the first token is sampled from the prompt's logits
            prefill_tok_s=t["prompt_per_second"],
            decode_tok_s=t["predicted_per_second"],
        )

    def scores(self, config: dict, prompt: list[int], continuation: list[int]) -> Any:
        """Teacher-forced scores of ``continuation`` under the GGUF's dequantized weights (the
        numpy forward of attnquant-core in float32), as ``attnquant_max.TokenScores``."""
        from attnquant_core.llama_reference import llama_logits
        from attnquant_max import TokenScores

        if not hasattr(self, "_state"):
            self._state = gguf_state(self.path)[0]
        ids = list(prompt) + list(continuation)
        logits = llama_logits(config, self._state, ids[:-1], dtype=np.float32)[len(prompt) - 1 :]
        return TokenScores.from_logits(logits, continuation)

    def close(self) -> None:
        self.server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build llama.cpp's tools into the cache")
    b.add_argument("--jobs", type=int)
    g = sub.add_parser("gguf", help="write a Hugging Face Llama checkpoint as a float32 GGUF")
    g.add_argument("checkpoint", type=Path)
    g.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "build":
        print(json.dumps(build(jobs=args.jobs), indent=2))
    else:
        print(hf_to_gguf(args.checkpoint, args.out))


if __name__ == "__main__":
    main()
