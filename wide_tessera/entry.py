"""The `wide_tessera` command's entry point: a Ctrl-C while torch and the package still load exits 130.

A KeyboardInterrupt raised inside an import can leave a half-imported module behind
(numpy's then recursed until RecursionError), so during loading Ctrl-C does not raise:
nothing has been measured or written yet, and the process simply ends.
"""

import os
import signal
from typing import Any


def _quit_while_loading(signum: int, frame: Any) -> None:
    os.write(2, b"\ninterrupted\n")
    os._exit(130)


def main() -> None:
    signal.signal(signal.SIGINT, _quit_while_loading)
    from .cli import main as cli_main  # installs its own Ctrl-C handling for the run

    cli_main()
