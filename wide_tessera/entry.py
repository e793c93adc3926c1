"""The `wide_tessera` command's entry point: a Ctrl-C while torch and the package still load exits 130.

A KeyboardInterrupt raised inside an import can leave a half-imported module behind
(numpy's then recursed until RecursionError), so during loading Ctrl-C does not raise:
nothing has been measured or written yet, and the process simply ends.

An interrupted run ends without the interpreter's teardown: by then what was measured is
saved and the file lock released, but the interrupt may have cut torch's profiler off
mid-session, and tearing down after that crashed with SIGSEGV (once in CI: two quick
Ctrl-Cs during gemm's first points, the file already saved).
"""

import os
import signal
import sys
from typing import Any


def _quit_while_loading(signum: int, frame: Any) -> None:
    os.write(2, b"\ninterrupted\n")
    os._exit(130)


def main() -> None:
    signal.signal(signal.SIGINT, _quit_while_loading)
    from .cli import main as cli_main  # installs its own Ctrl-C handling for the run

    try:
        cli_main()
    except SystemExit as e:
        if e.code != 130:
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
