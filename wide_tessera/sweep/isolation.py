"""Run a job's points in a child process, so a hang or a crash costs one strategy, not the run.

The worker (this module run as a program) gets the pickled job on stdin and sends
back, over a pipe, a message as each stage starts and each finished point as data.
While timing, it also writes which function is about to run into a small shared
memory slot (a write per sample, no message), so that a crash or a hang in warm-up
or measurement is charged to that function, not the whole point. The parent kills
the worker's whole process group when a stage outlives its limit, records the
crash or timeout where it happened, and starts a new worker: at the same point
without the culprit strategy, or at the next point if the point itself (its setup
or baseline) was the culprit. The worker dies with its parent.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Generator, Iterator, List, Optional, Set, Tuple

from ..core.errors import WideTesseraError
from ..core.job import BenchmarkJob
from ..core.roles import BASELINE, CONTROLS
from ..results.analysis import failed_point
from ..results.schema import Failure, PointResult
from .point import RunSettings, iter_points

__all__ = ["iter_points_isolated", "call_isolated", "check_picklable"]

# Past a stage's limit, the worker's own alarm gets this long to report a timeout
# gracefully before the parent kills it (a hang in C code never reports).
_GRACE_S = 5.0
_HEADER = struct.Struct("<Q")
# The shared slot: the index (in `_functions(job)`) of the function being timed, -1 for none.
_SLOT = struct.Struct("<i")
# How long a worker for an up-front check may take to start (a fresh interpreter imports torch).
_STARTUP_S = 120.0
# prctl(2): ask the kernel to send this signal to the worker when its parent dies.
_PR_SET_PDEATHSIG = 1


def iter_points_isolated(
    job: BenchmarkJob, settings: RunSettings, skip: Optional[Set[str]] = None, facts: bool = True
) -> Generator[PointResult, None, None]:
    points = job.sweep.points()
    start, excluded = 0, {}
    while start < len(points):
        worker = _Worker(job, settings, start, skip or set(), excluded, facts)
        try:
            for index, point in worker.points():
                yield point
                start, excluded = index + 1, {}
        finally:
            worker.kill()
        if worker.stage is None:  # finished, or died before starting a point
            if worker.finished:
                return
            raise RuntimeError(f"the isolated worker for {job.op} exited ({worker.exit_reason()}) before any point")
        index, stage, strategy, limit, since = worker.stage
        failure = worker.failure(stage, limit, since)
        if stage in ("warmup", "measure"):
            strategy = worker.timed_function()
        if strategy in (None, BASELINE):
            n, params = points[index]
            yield failed_point(n, params, {"point": failure})
            start, excluded = index + 1, {}
        else:
            start, excluded = index, {**excluded, strategy: failure}


def call_isolated(fn: Callable[[], Any], limit_s: float, what: str) -> Any:
    """`fn()`, run in a child process under a time limit; its error, crash or hang becomes a WideTesseraError.

    For the checks made before a run starts (benchmark_custom's look at the module): under
    `isolate`, a module that segfaults or hangs must not take the caller with it.
    """
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch state
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_call_and_report, args=(fn, send), daemon=True)
    try:
        child.start()
    except Exception as e:  # noqa: BLE001  fn cannot be pickled
        raise WideTesseraError(f"isolate: {what} cannot be sent to a worker process ({e})") from None
    send.close()
    # The limit is the check's own: starting the interpreter and importing torch come first.
    for wait_s in (_STARTUP_S, limit_s):
        if not receive.poll(wait_s):
            child.kill()
            child.join()
            raise WideTesseraError(f"{what} did not finish within {wait_s:.0f} s")
        try:
            message = receive.recv()
        except EOFError:  # died without a word
            child.join()
            raise WideTesseraError(f"{what} crashed the worker process ({_exit_text(child.exitcode)})") from None
    child.join()
    failed, value = message
    if failed:
        raise WideTesseraError(value)
    return value


def _call_and_report(fn: Callable[[], Any], send: Any) -> None:
    """Sends (False, what fn returned), or (True, its error as text)."""
    send.send("ready")  # fn has been unpickled: its module, and torch, are imported
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001  the check's own error goes to the parent as text
        send.send((True, str(e)))
        return
    send.send((False, value))


def _exit_text(code: Optional[int]) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def check_picklable(job: BenchmarkJob) -> None:
    """A clear error now, before any point, for a job that cannot be sent to a worker process."""
    try:
        pickle.dumps(job)
    except Exception as e:  # noqa: BLE001  whatever pickling raises, in one line
        raise WideTesseraError(
            f"isolate: {job.op}'s job cannot be sent to a worker process ({e}); define the op class "
            "(or custom model class) in an importable module, not in __main__ or a function"
        ) from None


class _Worker:
    def __init__(
        self,
        job: BenchmarkJob,
        settings: RunSettings,
        start: int,
        skip: Set[str],
        excluded: Dict[str, Failure],
        facts: bool,
    ):
        read_fd, write_fd = os.pipe()
        self.functions = _functions(job)
        with tempfile.TemporaryFile() as slot_file:
            slot_file.write(_SLOT.pack(-1))
            slot_file.flush()
            self.slot = mmap.mmap(slot_file.fileno(), _SLOT.size)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "wide_tessera.sweep.isolation", str(write_fd), str(slot_file.fileno())],
                stdin=subprocess.PIPE,
                pass_fds=(write_fd, slot_file.fileno()),
                start_new_session=True,  # its own process group, so a kill takes its children too
                env=env,
            )
        os.close(write_fd)
        self.pipe = os.fdopen(read_fd, "rb", buffering=0)
        self.proc.stdin.write(pickle.dumps((job, settings, start, skip, excluded, facts, os.getpid())))
        self.proc.stdin.close()
        self.stage: Optional[Tuple[int, str, Optional[str], float, float]] = None
        self.raised: Optional[Tuple[str, str]] = None
        self.finished = False
        self.timed_out = False

    def points(self) -> Iterator[Tuple[int, PointResult]]:
        while True:
            message = self._receive()
            if message is None:
                return
            if message[0] == "stage":
                _, index, stage, strategy, limit = message
                self.stage = (index, stage, strategy, limit, time.monotonic())
            elif message[0] == "point":
                self.stage = None
                yield message[1], PointResult.from_dict(message[2])
            elif message[0] == "raised":
                self.raised = message[1], message[2]
            else:
                self.finished = True
                return

    def _receive(self) -> Optional[Any]:
        header = self._read(_HEADER.size)
        if header is None:
            return None
        return pickle.loads(self._read(_HEADER.unpack(header)[0]) or b"")

    def _read(self, size: int) -> Optional[bytes]:
        data = b""
        while len(data) < size:
            timeout = None
            if self.stage is not None:
                _, _, _, limit, since = self.stage
                timeout = max(0.0, since + limit + _GRACE_S - time.monotonic())
            ready, _, _ = select.select([self.pipe], [], [], timeout)
            if not ready:
                self.timed_out = True
                self.kill()
                return None
            chunk = self.pipe.read(size - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.pipe.close()

    def timed_function(self) -> Optional[str]:
        """The function the timer was running when the worker stopped answering."""
        index = _SLOT.unpack(self.slot[: _SLOT.size])[0]
        return self.functions[index] if 0 <= index < len(self.functions) else None

    def exit_reason(self) -> str:
        return _exit_text(self.proc.returncode)

    def failure(self, stage: str, limit: float, since: float) -> Failure:
        elapsed = time.monotonic() - since
        if self.timed_out:
            message = f"{stage} exceeded its {limit:.1f} s limit; the worker was killed"
            return Failure(stage, "timeout", "Timeout", message, elapsed, limit)
        reason = self.exit_reason()
        if self.raised is not None:  # SystemExit or KeyboardInterrupt from the measured code
            error_type, message = self.raised
            return Failure(stage, "crash", error_type, f"the worker process stopped: {error_type}: {message}")
        kind = reason.split()[-1] if reason.startswith("killed") else "Exit"
        return Failure(stage, "crash", kind, f"the worker process died ({reason}) during {stage}")


def _functions(job: BenchmarkJob) -> List[str]:
    """Every function a point may time: the controls too, or the worker fails them by name."""
    return [BASELINE, *job.strategies, *CONTROLS]


def _die_with(parent: int) -> None:
    """End this worker when `parent` ends, so that a killed run leaves no worker behind."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    else:  # no prctl: watch for the parent to go (a hang that holds the GIL outlives it)

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def _worker_main(write_fd: int, slot_fd: int) -> None:
    job, settings, start, skip, excluded, facts, parent = pickle.load(sys.stdin.buffer)
    _die_with(parent)
    out = os.fdopen(write_fd, "wb", buffering=0)
    slot = mmap.mmap(slot_fd, _SLOT.size)
    index_of = {name: i for i, name in enumerate(_functions(job))}

    def send(message: Any) -> None:
        data = pickle.dumps(message)
        out.write(_HEADER.pack(len(data)) + data)

    current = [start]

    def observe(index: int, stage: str, strategy: Optional[str], limit: float) -> None:
        current[0] = index
        slot[: _SLOT.size] = _SLOT.pack(-1)
        send(("stage", index, stage, strategy, limit))

    def timing(name: str) -> None:
        slot[: _SLOT.size] = _SLOT.pack(index_of[name])

    try:
        points = iter_points(job, settings, start, skip, excluded, observe, timing, facts)
        for point in points:
            send(("point", current[0], point.to_dict()))
    except (SystemExit, KeyboardInterrupt) as e:  # raised by the measured code: say what it was
        send(("raised", type(e).__name__, str(e)))
        raise
    send(("done",))


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
