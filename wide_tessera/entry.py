"""The `wide_tessera` command's process: Ctrl-C at any moment, the exit status, the end.

While torch and the package still load, a Ctrl-C exits 130 at once: a KeyboardInterrupt raised
inside an import can leave a half-imported module behind (numpy's then recursed until
RecursionError), and nothing has been measured or written yet.

During the run, the first Ctrl-C raises KeyboardInterrupt as usual and the run saves what it
measured; a second one, during that save or the interpreter's shutdown, ends the process at
once without a traceback (saves replace files atomically, so what is on disk stays whole).
click turns KeyboardInterrupt into an 'Aborted!' exit 1, so its own handling is bypassed
(standalone_mode=False) and redone here.

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


def _first_interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGINT, _second_interrupt)
    raise KeyboardInterrupt


def _second_interrupt(signum: int, frame: object) -> None:
    os.write(sys.stderr.fileno(), b"\ninterrupted again: exiting now\n")
    os._exit(130)


def run() -> int:
    """Run the command line in this process; its exit status. Ctrl-C during start-up or during
    the run is 130, without a traceback."""
    signal.signal(signal.SIGINT, _quit_while_loading)
    import click

    from .cli import cli

    signal.signal(signal.SIGINT, _first_interrupt)
    try:
        returned = cli.main(prog_name="wide_tessera", standalone_mode=False)
        code: Any = returned if isinstance(returned, int) else 0
    except click.UsageError as e:  # bad input: its one line, without click's usage lines above it
        click.echo(f"Error: {e.format_message()}", err=True)
        code = e.exit_code
    except click.ClickException as e:
        e.show()
        code = e.exit_code
    except (click.Abort, KeyboardInterrupt):
        click.echo("\ninterrupted", err=True)
        code = 130
    except SystemExit as e:
        code = 0 if e.code is None else e.code
    finally:
        # Nothing is left to interrupt. At shutdown Python puts back the default for a Python
        # handler (a late Ctrl-C would then kill the process: status -2), but not for SIG_IGN.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not isinstance(code, int):  # sys.exit("message"): Python prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    return code


def main() -> None:
    code = run()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
