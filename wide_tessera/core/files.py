"""Results files on disk: where a write goes, an atomic replace that keeps the mode, one writer at a time."""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

import psutil
from filelock import FileLock, Timeout

from .errors import WideTesseraError

__all__ = [
    "results_target",
    "not_a_regular_file",
    "write_atomic",
    "make_folder",
    "results_lock",
    "lock_path",
    "cache_dir",
]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_regular_file(path: Path) -> Optional[str]:
    """What `path` is ('a FIFO', 'a directory', ...) if it exists and is not a regular file, else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), "not a regular file")


def results_target(path: Union[str, Path]) -> Path:
    """The file a write to `path` replaces: a symlink's target (so the link keeps working), checked.

    Refuses anything that exists and is not a regular file: writing there would replace a
    device node or a FIFO with a JSON file (`-o /dev/full` once did exactly that).
    """
    if not str(path):
        raise WideTesseraError("'': give a file name")
    target = Path(path).resolve()
    kind = not_a_regular_file(target)
    if kind is not None:
        raise WideTesseraError(f"{path}: is {kind}, not a results file; give a regular file path")
    if len(target.name.encode()) > _name_max(target.parent):
        raise WideTesseraError(
            f"{path}: the file name is longer than the {_name_max(target.parent)} bytes this file system takes"
        )
    if not target.parent.is_dir():
        raise WideTesseraError(f"{path}: folder {str(target.parent)!r} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise WideTesseraError(f"{path}: folder {str(target.parent)!r} is not writable")
    return target


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def make_folder(path: Union[str, Path], what: str = "folder") -> Path:
    """`path` as a folder, made (with its parents) where it is missing; the OS's refusal (a file in
    the way, a read-only file system, no permission) is one WideTesseraError naming the path."""
    if not str(path):
        raise WideTesseraError(f"'': give a {what} name")
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WideTesseraError(f"{path}: cannot make this {what} ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK):
        raise WideTesseraError(f"{path}: this {what} is not writable")
    return folder


def _new_file_mode(target: Path) -> int:
    """An existing file keeps its mode; a new one gets what the user's umask gives (normally 0644).

    mkstemp creates its file 0600, and the rename would carry that over; os.umask is the only
    way to read the mask, so it is set and put straight back.
    """
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mask = os.umask(0o022)
        os.umask(mask)
        return 0o666 & ~mask


def write_atomic(path: Union[str, Path], text: str) -> None:
    """Write `text` to a temporary file beside the target and rename it over the target.

    A run killed mid-write leaves the previous complete file, never a truncated one; a write the
    OS refuses (a full disk, a read-only file system) is one WideTesseraError saying so, and the
    previous file, where there was one, is intact.
    """
    target = results_target(path)
    existed = target.exists()
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        raise _refused(path, e, existed) from None
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), _new_file_mode(target))
            f.write(text)
        os.replace(tmp, target)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise _refused(path, e, existed) from None
        raise


def _refused(path: Union[str, Path], error: OSError, existed: bool) -> WideTesseraError:
    kept = "the earlier file is intact" if existed else "nothing was written"
    return WideTesseraError(f"{path}: could not be written ({error.strerror or error}); {kept}")


def cache_dir() -> Path:
    """The per-user cache directory: $WIDE_TESSERA_CACHE_DIR, else $XDG_CACHE_HOME/wide_tessera,
    else ~/.cache/wide_tessera (the roofline's measured peaks, the default dispatch table)."""
    root = os.environ.get("WIDE_TESSERA_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    ) / "wide_tessera"
    return Path(root)


def lock_path(path: Union[str, Path]) -> Path:
    """The lock file beside a results file (beside its target, for a symlink); it holds the writer's PID."""
    target = Path(path).resolve()
    return target.with_name(target.name + ".lock")


def _write_pid(fd: int) -> None:
    # filelock opens the lock file without truncating it and calls this only once it holds
    # the lock, so a contender that fails never erases the holder's PID.
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _holder(lock: Path) -> str:
    """'PID 1234 (wide_tessera benchmark gemm -o r.json)', as far as it can be told."""
    try:
        pid = int(lock.read_text().strip())
    except (OSError, ValueError):
        return "another process"
    try:
        command = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return f"PID {pid}"
    return f"PID {pid} ({command})" if command else f"PID {pid}"


@contextmanager
def results_lock(path: Union[str, Path], wait_s: float = 0.0) -> Iterator[None]:
    """Hold an exclusive lock on the results file `path` for the block; if another process holds
    it, wait up to `wait_s` seconds for it (0: fail at once).

    Two runs writing one file would each replace the other's results. The lock is an OS
    lock (flock) on `<file>.lock`, so it dies with its holder; the lock file itself is
    left in place, as deleting a lock file lets two processes hold locks on different inodes.
    """
    lock = lock_path(path)
    try:
        held = FileLock(str(lock), timeout=wait_s, blocking=wait_s > 0, on_acquired=_write_pid)
        held.acquire()
    except Timeout:
        waited = f" (waited {wait_s:g} s)" if wait_s > 0 else ""
        raise WideTesseraError(
            f"{path}: {_holder(lock)} is writing it{waited}; wait for it to finish or give another file"
        ) from None
    except OSError as e:
        raise WideTesseraError(f"{path}: cannot lock {lock} ({e.strerror or e})") from None
    try:
        yield
    finally:
        held.release()
