"""Writing a checkpoint directory atomically: a temporary sibling renamed into place, under a lock."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .._errors import (
    AttnquantError,
    OutputBusyError,
    OutputError,
)
from ._checkpoint import (
    INDEX_FILE,
)
from ._manifest import (
    MANIFEST_FILE,
)
from ._safetensors import (
    DIGESTS_FILE,
)

__all__ = ["atomic_directory", "copy_side_files", "write_atomic"]


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write`` on a temporary sibling of ``path``, then rename it into place: a failed
    or killed write leaves ``path`` as it was."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # keeps the suffix (format)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` only if the block succeeds.

    Survives faults: a failed block (a full disk included) removes the temporary directory and
    raises :class:`OutputError`; a killed run leaves only its temporary directory, which the next
    run writing ``out`` removes. Two runs writing ``out`` at once cannot both proceed: a lock
    (``.<name>.lock``, ``flock``, released by the kernel however its holder dies) makes the
    second fail at once with :class:`OutputBusyError`. ``out`` is checked again under the lock,
    so a run never replaces what another finished meanwhile unless ``overwrite``.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; remove it or pass overwrite=True")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _output_lock(out):
        for kind in ("tmp", "old"):  # left by a killed run: no live run holds them now
            for stale in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} already exists; remove it or pass overwrite=True")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            try:
                yield tmp
            except OSError as exc:
                if isinstance(exc, AttnquantError | FileExistsError | FileNotFoundError):
                    raise
                raise OutputError(f"{out}: not written, nothing left behind ({exc})") from exc
            if out.exists():
                if not overwrite:
                    raise FileExistsError(f"{out} already exists; remove it or pass overwrite=True")
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.replace(out, old / out.name)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out)
            _fsync_directory(out.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _output_lock(out: Path) -> Iterator[None]:
    """Hold ``.<out name>.lock`` beside ``out`` exclusively, or raise :class:`OutputBusyError`."""
    import fcntl

    lock = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusyError(
                f"{out}: another attnquant run is writing it now (lock {lock.name}); wait for "
                f"it to finish or write elsewhere"
            ) from None
        try:  # the file we locked may have been unlinked by its previous holder: lock anew
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def copy_side_files(src_dir: Path | None, dst: Path) -> None:
    """Copy config, tokenizer and other non-tensor files of a checkpoint directory into ``dst``."""
    if src_dir is None or not src_dir.is_dir():
        return
    for item in sorted(src_dir.iterdir()):
        if (
            item.is_file()
            and item.suffix != ".safetensors"
            and item.name not in {INDEX_FILE, MANIFEST_FILE, DIGESTS_FILE}
            and not item.name.startswith(".")
        ):
            shutil.copy2(item, dst / item.name)
