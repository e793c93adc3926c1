"""Files of ours on disk: where a write goes and what it may replace, an atomic replace that keeps
the mode, one writer at a time."""

from __future__ import annotations

import json
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
    "RESULTS",
    "REPORT",
    "PLOT",
    "results_target",
    "held_by",
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


# What a file of ours holds, in the words a refusal uses; a JSON document marked by its "format"
# (a dispatch table, a collectives run) holds 'a <format>'. Each is told by what the file starts
# with: results.schema writes '{"schema_version": ...', a report page starts with its title and a
# plot carries its title in its metadata (reports.plots).
RESULTS = "results"
REPORT = "a wide_tessera report"
PLOT = "a wide_tessera plot"
_HEAD = 4096  # the bytes read to tell a file's kind; JSON that does not say in them is parsed whole


def held_by(path: Union[str, Path]) -> Optional[str]:
    """What the file at `path` holds, in words: RESULTS, REPORT, PLOT, 'a wide_tessera dispatch
    table', 'JSON of another program', 'text' or 'binary data'; None where nothing is there to lose
    (no file, or an empty one)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return None
    if not head.strip():
        return None
    if head.startswith(b'{"schema_version"'):
        return RESULTS
    if head.startswith(b"# wide_tessera report"):
        return REPORT
    if b"wide_tessera plot" in head:
        return PLOT
    if head.lstrip().startswith(b"{"):
        try:
            document = json.loads(Path(path).read_bytes())
        except (ValueError, RecursionError, OSError):
            document = None
        if isinstance(document, dict) and "schema_version" in document and "results" in document:
            return RESULTS
        if isinstance(document, dict) and str(document.get("format", "")).startswith("wide_tessera "):
            return f"a {document['format']}"
        if document is not None:
            return "JSON of another program"
    try:
        head.decode()
    except UnicodeDecodeError:
        return "binary data"
    return "text"


def results_target(path: Union[str, Path], holds: Optional[str]) -> Path:
    """The file a write of `holds` (RESULTS, REPORT, PLOT, 'a <format>') to `path` replaces: a
    symlink's target (so the link keeps working), checked. The one rule for every file we write:

    * anything that exists and is not a regular file is refused: writing there would replace a
      device node or a FIFO with a JSON file (`-o /dev/full` once did exactly that);
    * a file is replaced only where it holds what the write holds: `-o notes.txt --overwrite`
      once replaced the user's notes with results, and a dispatch table given as `-o` its
      measured verdicts. holds=None: a cache kept in a folder of ours, at a name the user does
      not give (the roofline's peaks), replaced whatever it holds.
    """
    if not str(path):
        raise WideTesseraError("'': give a file name")
    target = Path(path).resolve()
    kind = not_a_regular_file(target)
    if kind is not None:
        wanted = "a results file" if holds == RESULTS else holds or "a file"
        raise WideTesseraError(f"{path}: is {kind}, not {wanted}; give a regular file path")
    if len(target.name.encode()) > _name_max(target.parent):
        raise WideTesseraError(
            f"{path}: the file name is longer than the {_name_max(target.parent)} bytes this file system takes"
        )
    if not target.parent.is_dir():
        raise WideTesseraError(f"{path}: folder {str(target.parent)!r} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise WideTesseraError(f"{path}: folder {str(target.parent)!r} is not writable")
    there = held_by(target) if holds is not None else None
    if there is not None and there != holds:
        raise WideTesseraError(f"{path}: holds {there}, not {holds}: it is never replaced; give another file")
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


def write_atomic(path: Union[str, Path], text: str, holds: Optional[str]) -> None:
    """Write `text`, which holds `holds` (see results_target: what it may replace), to a temporary
    file beside the target and rename it over the target.

    A run killed mid-write leaves the previous complete file, never a truncated one; a write the
    OS refuses (a full disk, a read-only file system) is one WideTesseraError saying so, and the
    previous file, where there was one, is intact.
    """
    target = results_target(path, holds)
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
        # A Ctrl-C can land after the rename, inside this block: tmp is gone then, and the
        # interrupt, not a missing temporary file, is what the caller must see.
        Path(tmp).unlink(missing_ok=True)
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
