"""The `wide_tessera` command: one module per family of commands, the options they share in
`options`. The process's entry point (Ctrl-C, exit status) is wide_tessera.entry."""

import click

from .collectives import collectives
from .measure import benchmark, custom, tune
from .ops import list_ops
from .options import parse_override
from .results import compare_runs, plot, report, show
from .runs import runs

__all__ = ["cli", "parse_override"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="wide_tessera")
def cli() -> None:
    """When does fusing N copies of an op beat N separate calls, and which strategy wins?"""


for command in (list_ops, benchmark, custom, tune, collectives, runs, show, compare_runs, plot, report):
    cli.add_command(command)
