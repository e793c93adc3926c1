"""Is a wide output the same as N separate calls? Relative error against a dtype-aware tolerance."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from dataclasses_json import dataclass_json

from . import trees

__all__ = [
    "Check",
    "tolerance",
    "check_outputs",
    "merge_checks",
    "nonfinite_reference",
    "vacuous_reference",
    "parameters_differ",
    "fallback_note",
    "shares_memory",
    "TrainedTolerance",
    "SGD_TRAINED",
    "ADAM_TRAINED",
    "check_trained",
    "TWIN_FACTOR",
]

# Norm-wise relative error allowed per dtype: a few units of rounding of the
# dtype, since a wide strategy sums in a different order than the baseline.
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# TF32 keeps a 10-bit mantissa, like float16.
_TF32_TOLERANCE = 5e-3


@dataclass_json
@dataclass(frozen=True)
class Check:
    """The verdict on one strategy at one point; `error` says why it failed.

    max_rel_error is the worst norm-wise relative error over the models and the input
    draws; per_model_rel_error / per_model_abs_error give each model's worst (relative,
    and largest absolute elementwise difference). `fallback` says when the strategy did
    not really fuse (vmap ran a per-model loop), `warnings` what else torch warned, `ran` how
    the wide module says it ran the N models (surgery: which layers it swapped, which it left
    to vmap), where it says.
    """

    correct: bool
    max_rel_error: Optional[float]
    tolerance: float
    error: Optional[str] = None
    per_model_rel_error: List[float] = field(default_factory=list)
    per_model_abs_error: List[float] = field(default_factory=list)
    draws: int = 1
    fallback: Optional[str] = None
    warnings: List[str] = field(default_factory=list)
    ran: Optional[str] = None


def tolerance(dtype: torch.dtype, device: str) -> float:
    """The relative-error bound for `dtype`; float32 on CUDA is judged as TF32 when torch allows TF32."""
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    if dtype == torch.float32 and torch.device(device).type == "cuda" and tf32:
        return _TF32_TOLERANCE
    return _TOLERANCE[dtype]


def nonfinite_reference(reference: Sequence[Any]) -> Optional[str]:
    """Why the N separate calls' outputs cannot judge anything (NaN or Inf in them), or None.

    A constant wide output compared with a NaN reference has a relative error of
    NaN, which no comparison rejects: such a point is unjudgeable, never 'correct'.
    """
    for i, ref in enumerate(reference):
        if any(t.is_floating_point() and not torch.isfinite(t).all() for t in trees.tensors(ref)):
            return f"unjudgeable: the separate call of model {i} gave NaN or Inf"
    return None


def vacuous_reference(reference: Sequence[Any], crossed: Optional[Any] = None) -> Optional[str]:
    """Why the N separate calls' outputs cannot tell a right strategy from a wrong one, or None.

    An output that is constant (all zeros, say) is what a strategy that mixes up or drops the
    models' parameters also gives. `crossed` is model 0 called on model 1's input: equal to
    model 1's own output, the output does not depend on the parameters either.
    """
    floats = [t for t in trees.tensors(reference) if t.is_floating_point() and t.numel()]
    if floats and all(bool((t == t.flatten()[0]).all()) for t in floats):
        return "cannot judge correctness: every output is constant, whatever the parameters"
    if crossed is not None and len(reference) > 1:
        mine, theirs = trees.tensors(crossed), trees.tensors(reference[1])
        # an empty output equals any other: an expert that received no tokens says nothing
        # (hf_experts at decode sizes was called unjudgeable for it)
        if any(t.is_floating_point() and t.numel() for t in mine) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(mine, theirs)
        ):
            return "cannot judge correctness: the output does not depend on the parameters"
    return None


def parameters_differ(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two models' floating-point parameters differ anywhere (a model without any: no)."""
    pairs = [(p, q) for p, q in zip(a.parameters(), b.parameters()) if p.is_floating_point() and p.numel()]
    return any(p.shape != q.shape or not torch.equal(p, q) for p, q in pairs)


def check_outputs(
    outputs: Sequence[Any],
    reference: Sequence[Any],
    tol: float,
    forbidden: Sequence[torch.Tensor] = (),
) -> Check:
    """Compare each of the N outputs with its reference by ||out - ref|| / ||ref||.

    An output may be a tensor or a tuple, list or dict of them (nn.GRU returns two):
    its structure must be the reference's, and the norms run over all its tensors.
    An output that shares memory with its reference, or with any tensor in
    `forbidden` (the strategy's own inputs, when the separate calls did not return
    theirs), is wrong whatever its values: it only looks right.
    """
    if len(outputs) != len(reference):
        return Check(False, None, tol, f"{len(outputs)} outputs for {len(reference)} models")
    rel_errors, abs_errors = [], []
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        (out_leaves, out_spec), (ref_leaves, ref_spec) = trees.flat(out), trees.flat(ref)
        if out_spec != ref_spec:
            return Check(False, None, tol, f"output {i} is a {_structure(out)}, expected a {_structure(ref)}")
        diff_sq = scale_sq = largest = 0.0
        for o, r in zip(out_leaves, ref_leaves):
            error = _leaf_error(o, r, forbidden)
            if error is not None:
                return Check(False, None, tol, f"output {i}{error}")
            if isinstance(r, torch.Tensor):
                diff = (o - r).double()
                diff_sq += torch.linalg.vector_norm(diff).item() ** 2
                scale_sq += torch.linalg.vector_norm(r.double()).item() ** 2
                largest = max(largest, diff.abs().max().item() if diff.numel() else 0.0)
        rel_errors.append(math.sqrt(diff_sq / scale_sq) if scale_sq > 0 else math.sqrt(diff_sq))
        abs_errors.append(largest)
    worst = max(rel_errors, default=0.0)
    if not math.isfinite(worst) or worst > tol:
        error = f"relative error {worst:.3g} exceeds tolerance {tol:.3g} (model {rel_errors.index(worst)})"
        return Check(False, worst, tol, error, rel_errors, abs_errors)
    return Check(True, worst, tol, None, rel_errors, abs_errors)


def _leaf_error(out: Any, ref: Any, forbidden: Sequence[torch.Tensor]) -> Optional[str]:
    """What is wrong with one leaf of an output, after the words 'output i', or None."""
    if not isinstance(ref, torch.Tensor):  # a plain value the module returns (a count, None): equal or wrong
        return None if _equal(out, ref) else f" holds {out!r:.80} where the separate call gave {ref!r:.80}"
    if not isinstance(out, torch.Tensor):
        return f" is a {type(out).__name__}, not a Tensor"
    if out.shape != ref.shape:
        return f" has shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if shares_memory(out, [ref]):
        return " shares memory with the reference output"
    if shares_memory(out, forbidden):
        return " shares memory with the strategy's input"
    if out.is_floating_point() and not torch.isfinite(out).all():
        return " contains NaN or Inf"
    return None


def _equal(out: Any, ref: Any) -> bool:
    """Whether a plain value equals the separate call's. A Tensor where the separate call gave an
    int is not (vmap returns one: `out == ref` was a Tensor, whose truth raised "Boolean value
    of Tensor with more than one value is ambiguous"), nor is a value whose == raises."""
    if isinstance(out, torch.Tensor):
        return False
    try:
        return bool(out == ref)
    except Exception:  # noqa: BLE001  a value whose == gives no truth (an array) is not the same value
        return False


def _structure(tree: Any) -> str:
    """How an output is built, for an error message: 'Tensor', 'tuple(Tensor, Tensor)', 'dict(h: Tensor)'."""
    if isinstance(tree, (tuple, list)):
        return f"{type(tree).__name__}({', '.join(map(_structure, tree))})"
    if isinstance(tree, dict):  # by its class: a ModelOutput and the plain dict of its fields read alike
        return f"{type(tree).__name__}({', '.join(f'{k}: {_structure(v)}' for k, v in tree.items())})"
    return "Tensor" if isinstance(tree, torch.Tensor) else type(tree).__name__


def merge_checks(checks: Sequence[Check], fallback: Optional[str], warnings: Sequence[str]) -> Check:
    """One strategy's verdict over several input draws: correct only if every draw is; each model's worst error."""
    failed = next((c for c in checks if not c.correct), None)
    first = failed or checks[0]
    per_rel = [max(errs) for errs in zip(*(c.per_model_rel_error for c in checks))] if failed is None else []
    per_abs = [max(errs) for errs in zip(*(c.per_model_abs_error for c in checks))] if failed is None else []
    return Check(
        first.correct,
        max(per_rel) if per_rel else first.max_rel_error,
        first.tolerance,
        first.error,
        per_rel or list(first.per_model_rel_error),
        per_abs or list(first.per_model_abs_error),
        len(checks),
        fallback,
        list(warnings),
    )


# torch's message when vmap has no batching rule for an operator and loops over the batch
# (torch/csrc/functorch/BatchedFallback.cpp). Hidden, it made a per-model loop look like a
# fused strategy that merely did not pay (nn.TransformerEncoderLayer under vmap).
_FALLBACK = re.compile(r"not yet implemented the batching rule for (\S+?)\.?(?:\s|$)")


def fallback_note(messages: Sequence[str]) -> Optional[str]:
    """'vmap ran a per-model loop: no batching rule for aten::x' when torch said so, else None."""
    ops = sorted({m.group(1) for m in map(_FALLBACK.search, messages) if m})
    return f"vmap ran a per-model loop: no batching rule for {', '.join(ops)}" if ops else None


def shares_memory(t: Any, others: Sequence[Any]) -> bool:
    """Whether tensor `t` lives in the same storage as any tensor in `others`."""
    if not isinstance(t, torch.Tensor):
        return False
    ptr = t.untyped_storage().data_ptr()
    return ptr != 0 and any(
        isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() == ptr for o in others
    )


@dataclass(frozen=True)
class TrainedTolerance:
    """How far N models trained as one may end from N separate trainings: at most `share` of each
    model's parameter elements farther than `atol + rtol * |value|` from its separate training's.

    Adam's first step is about lr * sign(g): a gradient near zero (a bias before a norm, a
    corner of a weight) flips it by summation order alone, so a correct fused Adam ends a few
    elements away; a wrong learning rate, a joint clip or a lost update moves nearly all of them.
    SGD is linear in its gradients: every element stays within a rounding of its reference.
    """

    rtol: float
    atol: float
    share: float

    def describe(self) -> str:
        allowed = f"; {self.share:.1%} of them may" if self.share else ""
        return f"each element within {self.atol:g} + {self.rtol:g} x |value|{allowed}"


# float32, after tens of steps (scripts and tests train 50): see TrainedTolerance
SGD_TRAINED = TrainedTolerance(rtol=1e-4, atol=1e-6, share=0.0)
ADAM_TRAINED = TrainedTolerance(rtol=1e-3, atol=1e-5, share=1e-3)


# A correct fused training ends at most this many times as far from the separate training as the
# separate training itself ends from its rounding twin (check_trained's `twin`).
TWIN_FACTOR = 4.0


def check_trained(
    got: Sequence[Dict[str, torch.Tensor]],
    want: Sequence[Dict[str, torch.Tensor]],
    tol: TrainedTolerance,
    twin: Optional[Sequence[Dict[str, torch.Tensor]]] = None,
) -> Check:
    """The N models' parameters (or any named tensors) after training as one, against the N
    separate trainings', model by model, by `tol`. `max_rel_error` is the worst model's
    norm-wise relative error; the error names the model, its share of elements out of
    tolerance and the tensor with most of them.

    `twin`: the separate trainings again, their parameters nudged by rounding noise before
    every step. Adam amplifies rounding: at hidden 256, N=32, after 10 steps at learning rates
    up to 1e-2, a fused training whose gradients matched the loop's to 2e-7 ended 1% to 2.5%
    of some models' elements away (a pre-activation within rounding of zero flips its ReLU,
    a row of gradients changes, and Adam takes a learning-rate-sized step in it). Such a flip
    lands on whichever model it lands on, so the twin's worst model sets the floor: a model
    may end as far from its separate training as TWIN_FACTOR times the twin's worst (and at
    least `tol.share`), while a wrong learning rate, a joint clip or a lost step moves most
    elements."""
    if len(got) != len(want):
        return Check(False, None, tol.rtol, f"{len(got)} trained models for {len(want)}")
    floor = max((_share_away(t, w, tol) for t, w in zip(twin, want)), default=0.0) if twin is not None else 0.0
    rel_errors = []
    for i, (g, w) in enumerate(zip(got, want)):
        if sorted(g) != sorted(w):
            return Check(False, None, tol.rtol, f"model {i} has {sorted(g)}, its separate training {sorted(w)}")
        off, total, worst, rel = _away(g, w, tol)
        if isinstance(off, str):
            return Check(False, None, tol.rtol, f"model {i}'s {off}")
        rel_errors.append(rel)
        allowed = max(tol.share, TWIN_FACTOR * floor)
        if off > allowed * total:
            twin_note = f", {TWIN_FACTOR:g} x the rounding twin's worst, {floor:.2%}" if allowed > tol.share else ""
            return Check(
                False,
                max(rel_errors),
                tol.rtol,
                f"model {i}: {off} of its {total} parameter elements ({off / total:.1%}) end away from its separate "
                f"training ({tol.describe()}{twin_note}), most in {worst[0]} ({worst[1]})",
                rel_errors,
            )
    return Check(True, max(rel_errors, default=0.0), tol.rtol, None, rel_errors)


def _share_away(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], tol: TrainedTolerance) -> float:
    off, total, _, _ = _away(got, want, tol)
    return off / total if isinstance(off, int) and total else 0.0


def _away(
    got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], tol: TrainedTolerance
) -> Tuple[Any, int, Tuple[str, int], float]:
    """(elements of `got` out of `tol` from `want`, or what is wrong with its shapes; elements in
    all; the tensor with most of them; the norm-wise relative error)."""
    off, total, worst, diff_sq, scale_sq = 0, 0, ("", -1), 0.0, 0.0
    for name, ref in want.items():
        mine = got[name]
        if mine.shape != ref.shape:
            return f"{name} has shape {tuple(mine.shape)}, not {tuple(ref.shape)}", 0, worst, 0.0
        if not ref.is_floating_point():
            off_here = int((mine != ref).sum())
        else:
            difference = (mine.detach().double() - ref.detach().double()).abs()
            off_here = int((~(difference <= tol.atol + tol.rtol * ref.detach().double().abs())).sum())  # NaN is off
            diff_sq += float(difference.pow(2).sum())
            scale_sq += float(ref.detach().double().pow(2).sum())
        off, total = off + off_here, total + ref.numel()
        worst = max(worst, (name, off_here), key=lambda pair: pair[1])
    return off, total, worst, math.sqrt(diff_sq / scale_sq) if scale_sq > 0 else math.sqrt(diff_sq)
