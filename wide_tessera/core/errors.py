"""wide_tessera's exceptions, one hierarchy, and what each becomes:

    WideTesseraError (ValueError)    something the user can act on, in one line that names it and what
    |                                would be valid; the CLI prints the line and exits 2 (usage_errors)
    +-- MissingDependency            an optional package is not installed
    +-- ContractError                an op class or a module breaks what wide_tessera relies on
    |   +-- NotApplicable            a strategy cannot apply to these models: skipped, never failed
    +-- DamagedFile                  a results file or dispatch table that is damaged or not ours
    MeasurementFault (Exception)     a fault while measuring a point (a stage over its time limit, a
                                     timed function that raised, energy that cannot be read): it
                                     becomes the point's Failure, and is never raised to the user
    Interrupted (KeyboardInterrupt)  Ctrl-C during a run: what was measured, and where it was saved;
                                     the CLI exits 130

Anything else raised from wide_tessera is a bug of ours or an error of the user's own code, which a
point records as a Failure where it happens inside a measurement; but torch's vmap refusing what it
was given (vmap_limitation) is a limitation of torch, which a point skips with torch's reason.
"""

from __future__ import annotations

import difflib
import re
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

if TYPE_CHECKING:
    from ..results.schema import BenchmarkResult

__all__ = [
    "WideTesseraError",
    "MissingDependency",
    "ContractError",
    "NotApplicable",
    "DamagedFile",
    "MeasurementFault",
    "Interrupted",
    "unknown",
    "one_line",
    "vmap_limitation",
]


class WideTesseraError(ValueError):
    """Something the user can act on: a value they gave, a module or file they pointed at. The
    message names it and what would be valid."""


class MissingDependency(WideTesseraError):
    """An op needs an optional package that is not installed: asked for by name, an error; in a run of
    every op (`--all`), a skip with this message."""


class ContractError(WideTesseraError):
    """An op class (its sweeps, strategies, factories) or a module breaks what wide_tessera relies on."""


class DamagedFile(WideTesseraError):
    """A file that should be ours is damaged, foreign or of a schema this version cannot read."""


class MeasurementFault(Exception):
    """A fault while measuring a point; the point records it as a Failure (sweep.point)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run: `result` holds what was measured of the job it stopped, marked
    incomplete; `output` is the file it was saved to (None: not saved), with `others`, the run's
    other jobs' results so far (every first pass comes before any confirmation, so the jobs
    after the one stopped may have points too)."""

    def __init__(
        self, result: "BenchmarkResult", output: Optional[str] = None, others: Sequence["BenchmarkResult"] = ()
    ):
        counts = [f"{len(result.points)} point(s) of {result.op}", *(f"{len(r.points)} of {r.op}" for r in others)]
        done = ", ".join(counts)
        saved = f"saved {done} to {output}" if output else f"{done} measured, not saved"
        super().__init__(saved)
        self.result, self.output = result, output


class NotApplicable(ContractError):
    """A strategy cannot apply to these models (surgery of a model it cannot capture): found when
    its wide module is built or first called, before any timing, and the runner skips it with
    this reason instead of failing it."""


def one_line(error: BaseException) -> str:
    """'TypeError: what it said', on one line, for an error raised by someone else's code: a
    model's multi-line message is folded, and an exception whose str() itself raises still
    gets its type named."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001  its __str__ is broken: the type is all there is
        text = "(its message could not be read)"
    text = " ".join(text.split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def unknown(kind: str, value: object, valid: Iterable[str]) -> WideTesseraError:
    """An error for a name that is not one of `valid`, suggesting the closest one."""
    valid = list(valid)
    close = difflib.get_close_matches(str(value), valid, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return WideTesseraError(f"unknown {kind} {value!r}{hint} (valid: {', '.join(valid)})")


# torch's own words (2.13) where its vmap cannot run what it was given, each reproduced: a
# limitation of torch, not a fault of the strategy or of the model. Each is matched where torch's
# message starts, and only on the RuntimeError torch raises: a user's error that quoted one of
# them ("my_kernel: Batching rule not implemented for this dtype") was skipped as torch's.
_BRANCH = "vmap: It looks like you're attempting to use a Tensor in some data-dependent control flow"
_VMAP_LIMITS = re.compile(
    "|".join(
        [
            r"vmap: We do not support batching operators that can",  # a data-dependent shape: nonzero, a mask index
            r"vmap: It looks like you're calling \.item\(\)",  # .item(), int(t), float(t)
            _BRANCH,
            r"vmap: inplace arithmetic\(self, \*extra_args\) is not possible",  # a value written into a shared tensor
            r"accessing `data` under vmap transform is not allowed",  # .data
            r".{0,80}mutating directly with `\.data` under vmap",  # Module.to() in forward (SwitchTransformers' router)
            r"In order to use an autograd\.Function with functorch transforms",  # no setup_context (BloomBlock's GeLU)
            r"You tried to vmap over \w+, but it does not have vmap support",  # an autograd.Function with no vmap rule
            r"Batching rule not implemented for aten::",  # an op with no rule and no fallback: aten::gru
        ]
    )
)


def vmap_limitation(error: BaseException) -> Optional[str]:
    """`error` in one line, said to be torch's, where it is torch's vmap refusing what it was given;
    None for any other error."""
    text = " ".join(str(error).split())
    if not isinstance(error, RuntimeError) or not _VMAP_LIMITS.match(text):
        return None
    said = f"torch's vmap cannot run it: {one_line(error)[:300]}"
    if _BRANCH in text:  # a tiny LlamaForCausalLM ran, until the N models' masks differed
        said += (
            " (a branch on a value of the models' tensors, which vmap cannot take per model: transformers' SDPA "
            "attention masks branch so where the models' masks differ; the surgery strategy or the loop runs them)"
        )
    return said
