"""Sessions: lint, one test session per package (synced alone), integration, build; by hand:
bench, lm-eval, gpu.

Every session installs from ``uv.lock`` into its own environment, so a package's test session
proves that the package installs and passes with nothing but its own dependencies.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.needs_version = ">=2024.4.15"

ROOT = Path(__file__).parent
PACKAGES = ("core", "kernels", "max", "cli")
# No session may reach a model hub or phone home.
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "MAX_SERVE_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# The sessions that compile MAX graphs run on pytest-xdist workers: a compile keeps about one
# core busy, so graphs compile side by side. Tests that share a graph share an xdist_group
# (one worker) and their conftest orders the groups longest compile first; xdist keeps that
# order (by default it would hand out the groups with the most tests first).
PARALLEL = ("--numprocesses", "auto", "--maxprocesses", "4", "--dist", "loadgroup")
PARALLEL += ("--no-loadscope-reorder",)
COMPILES = ("kernels", "max")


def sync(session: nox.Session, *args: str) -> None:
    """Install from the lock into this session's environment (never re-resolving)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
    )


@nox.session(tags=["lint"])
def lint(session: nox.Session) -> None:
    """ruff format --check and ruff check over the whole tree."""
    sync(session, "--only-group", "dev")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


def _package_tests(pkg: str):
    def run(session: nox.Session) -> None:
        sync(session, "--package", f"attnquant-{pkg}", "--group", "test")
        # attnquant-core must stand without MAX; attnquant-cli without attnquant-max, whose
        # commands that serve come with the `serve` extra (not synced here).
        absent = {"core": ("max",), "cli": ("max", "attnquant_max")}.get(pkg, ())
        if absent:
            session.run(
                "python",
                "-c",
                "import importlib.util, sys; "
                f"found = [m for m in {absent!r} if importlib.util.find_spec(m)]; "
                f"sys.exit(f'{{found}} importable in the {pkg} env' if found else 0)",
            )
        parallel = PARALLEL if pkg in COMPILES else ()
        session.run(
            "pytest", f"packages/attnquant-{pkg}/tests", *parallel, *session.posargs, env=OFFLINE
        )

    run.__doc__ = f"Tests of attnquant-{pkg}, in an environment holding only that package."
    return run


for _pkg in PACKAGES:
    nox.session(_package_tests(_pkg), name=f"tests-{_pkg}", tags=["tests"])


@nox.session(tags=["tests"])
def integration(session: nox.Session) -> None:
    """Cross-package tests (root tests/): CLI round trips, serving end to end through MAX."""
    sync(session, "--all-packages", "--group", "dev", "--group", "test-integration")
    session.run("pytest", "tests", *PARALLEL, *session.posargs, env=OFFLINE)


@nox.session
def build(session: nox.Session) -> None:
    """Build every wheel and sdist, then check what each wheel ships."""
    sync(session, "--only-group", "dev")
    dist = Path(session.create_tmp()) / "dist"
    session.run("uv", "build", "--all-packages", "--out-dir", str(dist), "--quiet")
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if len(wheels) != len(PACKAGES) or len(sdists) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} wheels and sdists, got {wheels + sdists}")
    for pkg in PACKAGES:
        module = f"attnquant_{pkg}"
        (wheel,) = [w for w in wheels if w.name.startswith(f"{module}-")]
        names = set(zipfile.ZipFile(wheel).namelist())
        src = ROOT / "packages" / f"attnquant-{pkg}" / "src"
        expected = {
            p.relative_to(src).as_posix()
            for p in (src / module).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
        missing = sorted(expected - names)
        if missing:
            session.error(f"{wheel.name} lacks {missing}")
        if pkg == "kernels" and not any(n.endswith(".mojo") for n in names):
            session.error(f"{wheel.name} ships no .mojo files")
        session.log(f"{wheel.name}: {len(names)} files, all {len(expected)} source files present")


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """The benchmark suite (slow, by hand): one results file, bench-results/results.json.

    ``nox -s bench`` runs every ``benchmarks/bench_*.py`` with its defaults. Names select
    scripts and any other arguments go to each selected script, so options that only one script
    knows need that script alone: ``nox -s bench -- bench_paths --repeats 12``.
    """
    import json

    sync(session, "--all-packages", "--group", "bench")
    tmp = Path(session.create_tmp())
    scripts = {s.stem: s for s in sorted((ROOT / "benchmarks").glob("bench_*.py"))}
    chosen = [a for a in session.posargs if a in scripts]
    extra = [a for a in session.posargs if a not in scripts]
    if extra and len(chosen) != 1:
        session.error(f"arguments {extra} need one script named before them, of {sorted(scripts)}")
    results = {}
    for name in chosen or scripts:
        out = tmp / f"{name}.json"
        session.run("python", str(scripts[name]), "--out", str(out), *extra, env=OFFLINE)
        results[name] = json.loads(out.read_text())
    (ROOT / "bench-results").mkdir(exist_ok=True)
    target = ROOT / "bench-results" / "results.json"
    target.write_text(json.dumps(results, indent=2) + "\n")
    session.log(f"wrote {target}")


@nox.session(name="lm-eval", default=False)
def lm_eval(session: nox.Session) -> None:
    """lm-eval's local-completions model scoring `attnquant serve` of the demo (by hand: lm-eval
    and its datasets stack are a heavy install). Writes bench-results/lm_eval.json."""
    sync(session, "--all-packages", "--group", "lm-eval")
    out = ROOT / "bench-results" / "lm_eval.json"
    out.parent.mkdir(exist_ok=True)
    script = str(ROOT / "benchmarks" / "lm_eval_demo.py")
    env = {**OFFLINE, "HF_DATASETS_OFFLINE": "1"}
    session.run("python", script, "--out", str(out), *session.posargs, env=env)


@nox.session(name="real-models", default=False)
def real_models(session: nox.Session) -> None:
    """Real trained checkpoints (the real-models group: SmolLM2-135M and Gemma 3 270M as GGUFs,
    package data): each imported and checked against llama.cpp (token ids, greedy text and
    log-probabilities), then judged with llama.cpp's quantizers on the same tensors
    (bench_peers). Needs llama.cpp built (python benchmarks/llamacpp.py build); by hand, as the
    models are a 350 MB install and the rows take about an hour each on 2 cores. Names select
    models: ``nox -s real-models -- smollm2``. Writes bench-results/real-<model>-*.json."""
    sync(session, "--all-packages", "--group", "bench", "--group", "real-models")
    models = [m for m in session.posargs if m in ("smollm2", "gemma3")] or ["smollm2", "gemma3"]
    results = ROOT / "bench-results"
    results.mkdir(exist_ok=True)
    session.run("python", "benchmarks/llamacpp.py", "build", env=OFFLINE)
    for model in models:
        session.run(
            "python",
            "benchmarks/real_models.py",
            model,
            "--out",
            str(results / f"real-{model}.json"),
            env=OFFLINE,
        )


@nox.session(default=False)
def gpu(session: nox.Session) -> None:
    """GPU checks (needs an NVIDIA accelerator; never part of CI)."""
    sync(session, "--all-packages", "--group", "dev", "--group", "test-integration")
    session.run("pytest", "tests", "-m", "gpu", *session.posargs, env={**OFFLINE, **os.environ})
