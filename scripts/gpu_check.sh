#!/usr/bin/env bash
# The prepared GPU check of issues 6, 7, 15, 17 and 35: one command for a lent GPU machine.
#
# What it measures, on the first accelerator MAX sees (an NVIDIA H200 when one is lent):
#   1. tests/test_gpu.py -m gpu -k "not nvfp4": the GPU variant of attnquant-kernels'
#      generated_linear, generated_mlp and generated_lowrank (issue 15: y = (x @ V) @ U.T, the
#      forms without W0, ranks up to 409) against the numpy identity
#      y = s*(x @ W0.T) + (x @ V) @ U.T (float32 within 1e-4, bfloat16 inputs within 2e-2, relative
#      to the largest output; ranks 0/16/64, batches 1/16/64 and a few projection-sized shapes;
#      SiLU and tanh-GELU)                                    -> $OUT/kernels_gpu_errors.json
#   1b. tests/test_gpu.py -m gpu -k linear_nvfp4 (issue 15): the GPU variant of the fused
#      generated_linear_nvfp4 (packed E2M1 codes and E4M3 scales decoded in registers, plus s and
#      the rank-r correction) against the float64 identity over the numpy-dequantized weight, ranks
#      0/16/64, batches 1/16, decode shapes of a 1B model; in the same graph nvfp4_dequantize
#      (the W^T a prefill multiplies by) bit for bit; one graph -> $OUT/kernels_gpu_errors.json
#   2. tests/test_gpu.py -m gpu -k "nvfp4 and not linear_nvfp4": the demo model served with ATTNQUANT_QUANT=nvfp4
#      (emulated: packed weights dequantized in the graph) against the unquantized model on
#      devices="gpu": max |logprob delta|, greedy agreement, weight bytes; encoding float32, else
#      bfloat16 (the one that ran is recorded)                -> $OUT/nvfp4_parity_gpu.json
#      and, in the same step, --quant-embedding's NVFP4 row lookup (gather_nvfp4_rows) on the GPU
#      against the numpy rows, bit for bit                    -> $OUT/nvfp4_embedding_gpu.json
#   3. tests/test_gpu.py -m gpu -k gemma (issue 17): a tiny Gemma 3 in bfloat16 (made in numpy,
#      4 layers, 2 sliding + 2 global, head_dim 128) served by MAX's stock Gemma3ForCausalLM, then
#      by attnquant's own Gemma 3 architecture (issue 53: Llama's pipeline, Gemma's blocks) from
#      the dense checkpoint (bf16 round-off against MAX's), the passthrough theta checkpoint (the
#      same log-probs as attnquant's dense) and G=1 r=16 (max |logprob delta| and greedy
#      agreement); batch-1 tok/s of each (device-graph capture: MAX 26.7 has none for Gemma 3,
#      off for all four); MAX's log-probs against the numpy Gemma 3 reference on the same
#      weights. Two graphs compiled (MAX's, and attnquant's shared by its three loads)
#                                                     -> $OUT/gemma3_gpu.json
#   4. benchmarks/bench_kernels.py --device gpu: one decoder layer's latency, custom op against
#      the GEMM formulation (ranks 16/64/4, batches 1/16/64, bootstrap 95% CIs), rewritten after
#      every case, in what is left of the budget        -> $OUT/bench_kernels_gpu.json
#   AQ_GPU_STEPS=REGEX runs only the steps whose name matches (e.g. AQ_GPU_STEPS=Gemma for step 3
#   alone; the device checks always run). The whole log goes to $OUT/gpu_check.log. Each step runs under `timeout`; a failing step does
#   not stop the next, and the exit status is 1 when any failed. The steps share a budget of
#   AQ_GPU_BUDGET_S seconds (default 520) counted once the environment is ready (~20 s).
#
# The environment. The lent H200 machine reaches no network and has Python 3.12 with PyTorch but
# no MAX, and one device-tool call carries at most 64 MiB (the working tree is ~14 MiB of it),
# while MAX, Mojo and what the image lacks unpack to ~650 MB. So they travel beforehand,
# xz-compressed in 3 parts of at most 47 MiB (build/ is ignored by git; the device tool carries
# ignored paths only when asked):
#
#   here (no GPU; network; ~10 min of CPU, no device time):
#       bash scripts/gpu_check.sh pack
#     -> build/gpu-env/part0 .. partN-1, each holding one site.tar.xz.K and the MANIFEST (sha256
#        of every part); prints the device-tool calls below with the real N.
#   device tool, one call per part but the last, back to back (a machine idle 30 s is given back,
#   and with it the parts it received):
#       run(command="bash scripts/gpu_check.sh receive", timeout_s=120, carry=["build/gpu-env/partK"])
#   device tool, the last part and the check itself:
#       run(command="bash scripts/gpu_check.sh", timeout_s=600, carry=["build/gpu-env/partN-1"])
#
# `run` (the default) takes the first environment that works: .venv/ when it imports max; the
# staged parts (all present, matching MANIFEST), unpacked to /tmp and put on PYTHONPATH before
# the packages' src/ folders, under the machine's python3; else, when PyPI answers, `uv sync
# --frozen --all-packages --group dev --group test-integration --group bench` (so on a GPU
# machine with a network, `bash scripts/gpu_check.sh` alone). With none it stops at once, saying
# so. HF_HUB_OFFLINE=1 and MAX_SERVE_DISABLE_TELEMETRY=1 throughout; $OUT (the device tool's
# folder that comes back) defaults to build/gpu-out.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ENV_DIR=build/gpu-env           # ignored (/build/ in .gitignore), so the device tool can carry it
PARKED=/tmp/aq-gpu-parts        # parts received on the device machine (kept while it is warm)
SITE=/tmp/aq-gpu-site           # the unpacked packages on the device machine
# One part + the working tree (~14 MiB) must stay under the device tool's 64 MiB a call: by
# default a part is 62 MiB less the working tree, at most 48 MiB (AQ_GPU_PART_MIB overrides).
PY_MINOR=3.12                   # the device image's python3
# What the device image lacks or holds at a version MAX 26.7 refuses (transformers <5.13 and its
# tokenizers), at the versions of uv.lock; everything else comes from the image.
# PyAV (av, 127 MB with its FFmpeg libraries) is replaced by a stub: max.pipelines imports it at
# start-up for video inputs only, and it would cost one more transfer.
PAYLOAD=(
    max max-core max-mojo-libs mojo-compiler mojo-compiler-mojo-libs
    gguf msgspec pydantic pydantic-core typing-inspection annotated-types
    taskgroup exceptiongroup psutil transformers tokenizers
)

export HF_HUB_OFFLINE=1 MAX_SERVE_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

say() { printf '\n=== %s [%ss]\n' "$*" "$SECONDS"; }
die() {
    printf 'gpu_check: %s\n' "$*" >&2
    exit 2
}

# ----------------------------------------------------------------------------- pack (here)

pack() {
    command -v uv >/dev/null || die "pack needs uv (https://docs.astral.sh/uv/)"
    local specs
    specs=$(
        python3 - "${PAYLOAD[@]}" <<'EOF'
import sys, tomllib
lock = {p["name"]: p["version"] for p in tomllib.load(open("uv.lock", "rb"))["package"]}
missing = [n for n in sys.argv[1:] if n not in lock]
if missing:
    sys.exit(f"not in uv.lock: {missing}")
print(" ".join(f"{n}=={lock[n]}" for n in sys.argv[1:]))
EOF
    )
    rm -rf "$ENV_DIR"
    mkdir -p "$ENV_DIR"
    say "downloading and unpacking for CPython $PY_MINOR, manylinux_2_34 x86_64: $specs"
    # Any local interpreter: the target's version and platform are given explicitly. Copies, not
    # links into uv's cache, whose inodes other uv processes touch while tar reads them.
    # shellcheck disable=SC2086
    UV_PYTHON_DOWNLOADS=never uv pip install --quiet --target "$ENV_DIR/site" \
        --python "$(command -v python3)" \
        --python-version "$PY_MINOR" --python-platform x86_64-manylinux_2_34 \
        --only-binary :all: --no-deps --no-compile-bytecode --link-mode copy $specs
    test -x "$ENV_DIR/site/modular/bin/mojo" || die "the unpacked packages hold no modular/bin/mojo"
    mkdir "$ENV_DIR/site/av"
    cat >"$ENV_DIR/site/av/__init__.py" <<'PYEOF'
"""Stub of PyAV for attnquant's staged GPU environment (scripts/gpu_check.sh): no video there."""


def __getattr__(name):
    raise AttributeError(f"av.{name}: PyAV is a stub in this environment (scripts/gpu_check.sh)")
PYEOF
    rm -rf "$ENV_DIR/site/modular/lib/nixl"/rocm* # AMD transfer plugins, never loaded on NVIDIA
    du -sh "$ENV_DIR/site"
    local tree_mib part_mib
    tree_mib=$(git ls-files -z --cached --others --exclude-standard |
        du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    tree_mib=$(((tree_mib + 1048575) / 1048576))
    part_mib=${AQ_GPU_PART_MIB:-$((62 - tree_mib < 48 ? 62 - tree_mib : 48))}
    ((part_mib >= 8)) || die "the working tree (${tree_mib} MiB) leaves no room for parts"
    say "compressing (xz -9; several minutes) into parts of ${part_mib} MiB (working tree ${tree_mib} MiB)"
    tar -C "$ENV_DIR" -cf - site | xz -T0 -9 -c | split -b "${part_mib}m" -d -a 1 - "$ENV_DIR/site.tar.xz."
    rm -rf "$ENV_DIR/site"
    local parts=("$ENV_DIR"/site.tar.xz.*) n k
    n=${#parts[@]}
    {
        echo "# attnquant GPU environment for CPython $PY_MINOR x86_64: $n parts"
        echo "# $specs"
        (cd "$ENV_DIR" && sha256sum site.tar.xz.*)
    } >"$ENV_DIR/MANIFEST"
    for ((k = 0; k < n; k++)); do
        mkdir "$ENV_DIR/part$k"
        mv "$ENV_DIR/site.tar.xz.$k" "$ENV_DIR/part$k/"
        cp "$ENV_DIR/MANIFEST" "$ENV_DIR/part$k/"
    done
    rm "$ENV_DIR/MANIFEST"
    ls -l "$ENV_DIR"/part*
    echo "Device-tool calls, in order and back to back (the machine is given back after 30 s idle):"
    for ((k = 0; k < n - 1; k++)); do
        echo "  run(command=\"bash scripts/gpu_check.sh receive\", timeout_s=120, carry=[\"$ENV_DIR/part$k\"])"
    done
    echo "  run(command=\"bash scripts/gpu_check.sh\", timeout_s=600, carry=[\"$ENV_DIR/part$((n - 1))\"])"
}

# ----------------------------------------------------------------------------- receive (device)

# A MANIFEST carried in this call, else the one parked by an earlier call.
manifest() {
    local m
    for m in "$ENV_DIR"/part*/MANIFEST "$PARKED/MANIFEST"; do
        if [[ -f "$m" ]]; then
            echo "$m"
            return 0
        fi
    done
}

# Park the parts carried so far in $PARKED (checked against MANIFEST); say what is there.
receive() {
    local list sum name have=0 total=0 found
    list=$(manifest)
    [[ -n "$list" ]] || die "no $ENV_DIR/part*/MANIFEST here: carry the folders 'pack' makes"
    mkdir -p "$PARKED"
    [[ "$list" == "$PARKED/MANIFEST" ]] || cp "$list" "$PARKED/MANIFEST"
    while read -r sum name; do
        total=$((total + 1))
        for found in "$ENV_DIR"/part*/"$name"; do
            if [[ -f "$found" && ! -f "$PARKED/$name" ]]; then
                cp "$found" "$PARKED/$name.tmp"
                mv "$PARKED/$name.tmp" "$PARKED/$name"
            fi
        done
        if [[ -f "$PARKED/$name" ]] && echo "$sum  $PARKED/$name" | sha256sum --check --status; then
            have=$((have + 1))
            echo "have $name"
        else
            rm -f "$PARKED/$name"
            echo "missing $name"
        fi
    done < <(grep -v '^#' "$PARKED/MANIFEST")
    echo "received $have of $total parts in $PARKED"
    ((have == total))
}

# ----------------------------------------------------------------------------- environments

PY=()

venv_ready() { [[ -x .venv/bin/python ]] && .venv/bin/python -c "import max.driver" >/dev/null 2>&1; }

staged_ready() { [[ -n "$(manifest)" ]] && receive; }

online() {
    timeout 8 python3 -c "import urllib.request; urllib.request.urlopen('https://pypi.org/simple/uv/', timeout=6)" \
        >/dev/null 2>&1
}

staged_env() {
    python3 -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$PY_MINOR'.split('.'))))" ||
        die "the staged packages are for CPython $PY_MINOR; python3 is $(python3 -V 2>&1)"
    if ! cmp -s "$PARKED/MANIFEST" "$SITE/MANIFEST"; then # not yet, or from another pack
        say "unpacking the staged packages to $SITE"
        rm -rf "$SITE"
        mkdir -p "$SITE"
        python3 - "$PARKED" "$SITE" <<'PYEOF'
import io, sys, tarfile
from pathlib import Path

parked, site = Path(sys.argv[1]), Path(sys.argv[2])
names = [line.split()[1] for line in (parked / "MANIFEST").read_text().splitlines()
         if line and not line.startswith("#")]


class Parts(io.RawIOBase):
    """The parts, read as one stream."""

    def __init__(self, paths):
        self.files = [open(p, "rb") for p in paths]

    def readable(self):
        return True

    def readinto(self, buf):
        while self.files:
            n = self.files[0].readinto(buf)
            if n:
                return n
            self.files.pop(0).close()
        return 0


stream = io.BufferedReader(Parts([parked / n for n in names]), 1 << 20)
with tarfile.open(fileobj=stream, mode="r|xz") as tar:
    tar.extractall(site, filter="tar")
PYEOF
        [[ -x "$SITE/site/modular/bin/mojo" ]] || die "unpacked $SITE, but it holds no modular/bin/mojo"
        cp "$PARKED/MANIFEST" "$SITE/MANIFEST"
    fi
    local src
    src=$(printf '%s:' "$ROOT"/packages/*/src)
    export PYTHONPATH="$SITE/site:${src%:}${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/site/modular/bin:$PATH"
    PY=(python3)
    echo "environment: staged packages ($SITE/site) + packages/*/src on $(python3 -V 2>&1)"
}

synced_env() {
    command -v uv >/dev/null || python3 -m pip install --quiet uv
    say "uv sync (locked)"
    uv sync --frozen --all-packages --group dev --group test-integration --group bench
    PY=("$ROOT/.venv/bin/python")
    echo "environment: .venv synced from uv.lock"
}

setup_env() {
    if venv_ready; then
        PY=("$ROOT/.venv/bin/python")
        echo "environment: existing .venv ($(.venv/bin/python -V 2>&1))"
    elif staged_ready; then
        staged_env
    elif online; then
        synced_env
    else
        die "no environment with MAX: no .venv, no complete set of staged parts (run 'bash scripts/gpu_check.sh pack' where there is a network and carry the parts: see this script's header), and no network for uv sync"
    fi
}

# ----------------------------------------------------------------------------- run (device)

FAILED=()
DEADLINE=0

# step NAME CAP_SECONDS CMD...: run CMD under timeout (CAP, or what is left of the budget).
step() {
    local name=$1 cap=$2 left rc=0 why
    shift 2
    if [[ -n "${AQ_GPU_STEPS:-}" && "$name" != "nvidia-smi" && "$name" != "MAX accelerator API" &&
        ! "$name" =~ $AQ_GPU_STEPS ]]; then
        say "$name: skipped (AQ_GPU_STEPS=$AQ_GPU_STEPS)"
        return 0
    fi
    left=$((DEADLINE - SECONDS))
    ((cap > left)) && cap=$left
    if ((cap < 20)); then
        say "$name: skipped, the time budget is spent"
        FAILED+=("$name (no time left)")
        return 0
    fi
    say "$name (timeout ${cap}s)"
    timeout --signal=INT --kill-after=20 "$cap" "$@" || rc=$?
    if ((rc != 0)); then
        why="exit $rc"
        if ((rc == 124 || rc == 137)); then why+=", timed out after ${cap}s"; fi
        FAILED+=("$name ($why)")
        echo "--- $name: $why"
    fi
    return 0
}

run_check() {
    : "${OUT:=$ROOT/build/gpu-out}"
    mkdir -p "$OUT"
    export AQ_GPU_REPORT_DIR="$OUT"
    exec > >(tee -a "$OUT/gpu_check.log") 2>&1
    say "gpu_check on $(hostname) at $(date -u +%FT%TZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    setup_env
    DEADLINE=$((SECONDS + ${AQ_GPU_BUDGET_S:-520}))

    step "nvidia-smi" 30 nvidia-smi
    step "MAX accelerator API" 90 "${PY[@]}" -c '
import importlib.metadata as md, sys, max.driver as d
print("python", sys.version.split()[0], "| max", md.version("max"), "| accelerator_api:", d.accelerator_api(),
      "| accelerator_count:", d.accelerator_count())
if d.accelerator_count():
    a = d.Accelerator()
    print("architecture:", d.accelerator_architecture_name(), "| device:", a.label, a.id)
else:
    raise SystemExit("MAX sees no accelerator")
'
    if ((${#FAILED[@]})) && [[ "${FAILED[-1]}" == "MAX accelerator API"* ]]; then
        echo "MAX does not see an accelerator here: nothing else can be checked."
        printf 'FAILED: %s\n' "${FAILED[@]}"
        exit 1
    fi
    local pytest=("${PY[@]}" -m pytest tests/test_gpu.py -m gpu -v -rA -W default -p no:cacheprovider)
    # Kernels first; NVFP4 (two Llama compiles, four if float32 is refused) and Gemma 3 (one
    # compile) before the benchmark, which rewrites its JSON after every case, so a timeout there
    # keeps the ranks measured.
    step "kernels on the GPU: generated_linear / generated_mlp vs numpy" 150 \
        "${pytest[@]}" -k "not nvfp4 and not gemma"
    step "fused NVFP4 op on the GPU: generated_linear_nvfp4 vs numpy" 120 \
        "${pytest[@]}" -k linear_nvfp4
    step "NVFP4 on the GPU: demo model parity, weight bytes, the embedding lookup" 240 \
        "${pytest[@]}" -k "nvfp4 and not linear_nvfp4"
    step "Gemma 3 bf16 on the GPU: stock vs attnquant dense, passthrough and G=1 r=16, tok/s" 300 \
        "${pytest[@]}" -k gemma
    step "latency on the GPU: custom op vs GEMM formulation" 300 \
        "${PY[@]}" benchmarks/bench_kernels.py --device gpu --ranks 16 64 4 --batches 1 16 64 \
        --repetitions 20 --inner 20 --out "$OUT/bench_kernels_gpu.json"

    say "results in $OUT"
    ls -l "$OUT"
    if ((${#FAILED[@]})); then
        printf 'FAILED: %s\n' "${FAILED[@]}"
        exit 1
    fi
    echo "all steps passed"
}

case "${1:-run}" in
pack) pack ;;
receive) receive || true ;;
run) run_check ;;
*) die "usage: $0 [run|pack|receive]" ;;
esac
