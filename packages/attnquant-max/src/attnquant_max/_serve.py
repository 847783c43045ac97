"""The ``max serve`` command line that serves a checkpoint through the attnquant architectures."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ._config import AttnquantConfig, require_implemented

__all__ = ["architectures_path", "max_entrypoint", "serve_command", "serve_env"]


def architectures_path() -> Path:
    """The folder to pass as ``--custom-architectures`` / ``custom_architectures=[...]``.

    It holds the module ``attnquant_architectures`` exposing ``ARCHITECTURES``.
    """
    return Path(__file__).resolve().parent / "attnquant_architectures"


def max_entrypoint() -> list[str]:
    """The argv prefix that runs MAX's command line from this environment.

    The ``max`` script installed next to the running interpreter when there is
    one, else ``python -m max._entrypoints.pipelines`` (what the script runs).
    """
    script = Path(sys.executable).with_name("max.exe" if os.name == "nt" else "max")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "max._entrypoints.pipelines"]


def serve_command(
    model_path: str | os.PathLike[str],
    *,
    port: int,
    host: str = "127.0.0.1",
    devices: str = "cpu",
    quantization_encoding: str | None = None,
    max_length: int | None = None,
    max_batch_size: int | None = None,
    served_model_name: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv of MAX's OpenAI-compatible server for ``model_path`` on the attnquant path.

    Parameters
    ----------
    model_path : path
        A local checkpoint directory, theta or dense.
    port, host : int, str
        Where the HTTP API listens; loopback by default.
    devices : str
        MAX's ``--devices``: ``"cpu"``, ``"gpu"``, ``"gpu:0,1"``.
    quantization_encoding : str, optional
        MAX's ``--quantization-encoding``; ``float32`` on CPU when not given
        (the only encoding MAX runs there), MAX's choice otherwise.
    max_length, max_batch_size : int, optional
        Passed through when given.
    served_model_name : str, optional
        The model name clients see (defaults to the path).
    extra_args : sequence of str
        Appended as they are.

    Run it with :func:`serve_env` as its environment.
    """
    if quantization_encoding is None and devices == "cpu":
        quantization_encoding = "float32"
    argv = [
        *max_entrypoint(),
        "serve",
        "--model-path",
        str(model_path),
        "--custom-architectures",
        str(architectures_path()),
        "--devices",
        devices,
        "--host",
        host,
        "--port",
        str(int(port)),
    ]
    if quantization_encoding is not None:
        argv += ["--quantization-encoding", quantization_encoding]
    if max_length is not None:
        argv += ["--max-length", str(int(max_length))]
    if max_batch_size is not None:
        argv += ["--max-batch-size", str(int(max_batch_size))]
    if served_model_name is not None:
        argv += ["--served-model-name", served_model_name]
    argv += list(extra_args)
    return argv


def serve_env(
    env: Mapping[str, str] | None = None, *, offline: bool = True, **attnquant: str
) -> dict[str, str]:
    """The environment for :func:`serve_command`: ``env`` (``os.environ``) plus offline settings.

    Telemetry off, ``HF_HUB_OFFLINE=1`` when ``offline``, and the
    ``attnquant_max`` logger let through max serve's log filter.

    ``attnquant`` sets ``ATTNQUANT_*`` variables by their lower-case suffix
    (``blocks="layers"``, ``rank="16"``). The result is validated as the server
    will read it, so a bad value or an unimplemented path fails here, before a
    subprocess starts.
    """
    out = dict(os.environ if env is None else env)
    out.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    # max serve's log handlers drop every logger outside max.* unless named here;
    # attnquant_max logs the chosen path and G, r once at load.
    components = [c for c in out.get("MAX_SERVE_LOGS_ENABLE_COMPONENTS", "").split(",") if c]
    if "attnquant_max" not in components:
        out["MAX_SERVE_LOGS_ENABLE_COMPONENTS"] = ",".join([*components, "attnquant_max"])
    if offline:
        out["HF_HUB_OFFLINE"] = "1"
    for name, value in attnquant.items():
        out[f"ATTNQUANT_{name.upper()}"] = str(value)
    require_implemented(AttnquantConfig.from_env(out))
    return out
