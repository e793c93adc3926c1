"""The `wide_tessera` command's entry point: a Ctrl-C while torch and the package still load exits 130.

A KeyboardInterrupt raised inside an import can leave a half-imported module behind
(numpy's then recursed until RecursionError), so during loading Ctrl-C does not raise:
nothing has been measured or written yet, and the process simply ends.

Every command ends without the interpreter's teardown, once its output is flushed: by then
what was measured is saved and the file lock released, and tearing down torch's C++ state
crashed more than once after the work was done. An interrupted run crashed with SIGSEGV (once
in CI: two quick Ctrl-Cs during gemm's first points, the file already saved); a torchrun
rank aborted ("terminate called without an active exception", SIGABRT) after rank 0 had
written the joined file, in 1 of 5 runs of test_two_ranks_write_one_file_with_every_point_once,
which made torchrun fail the run.
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
        code: Any = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code
    if not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
