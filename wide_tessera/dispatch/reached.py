"""Which of N models' outputs reached a backward: the models whose parts of a wide tensor have a
gradient as N separate models' tensors would have one.

A separate model left out of a step's loss (a bagging member with no sample in the batch, a
critic updated every other step, any `if` over models) has `grad` None, and torch's optimizers
skip it: no weight decay, no momentum, no step counted. In a wide tensor its part gets a zero
gradient, and a zero is not the sign: a model in the loss may have a gradient of exact zeros,
which torch steps. Stepped anyway, a model that sat out two of five steps ended 0.045 from its
separate training under SGD with momentum and weight decay, 0.026 under AdamW.

So the outputs are watched. Each tensor of a forward's output gets a hook, and so does each
tensor of each model's output as `unpack` splits it: a backward through model i's output marks
model i; one through an output never unpacked (its wide tensor in the loss as a whole) marks
every model. An output both unpacked and used whole (`sum(parts[:2]) + 0.1 * out.mean()`) marks,
besides the models whose parts were used, every model whose part of the wide tensor's gradient
is not zero (the gradient split as `unpack` splits the output): the parts' hooks alone left the
models reached through the whole tensor out, and their steps were skipped. Gradients set to None
(`zero_grad()`) start a new record, as they start torch's.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Set

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..core import trees

__all__ = ["Reached"]


class _Output:
    """One forward's output: whether `unpack` split it (then its models' own hooks mark them)."""

    __slots__ = ("unpacked",)

    def __init__(self) -> None:
        self.unpacked = False


class Reached:
    """The record of which of N models' outputs a backward reached since gradients were last set
    to None. `models` is None until a backward reaches a watched output: then nothing is known,
    and every model counts by its gradient."""

    def __init__(self, n: int):
        self.n = n
        self._marked: Optional[Set[int]] = None
        # per backward through an unpacked output, a bool tensor of N: whose part of its gradient
        # is not zero; read when `models` is (a GPU syncs once, at the optimizer's step)
        self._pending: List[torch.Tensor] = []
        self._outputs: WeakIdKeyDictionary = WeakIdKeyDictionary()  # an output's tensor -> its _Output

    @property
    def models(self) -> Optional[Set[int]]:
        """The models a backward reached since the last clear(); None where none has."""
        for flags in self._pending:
            chosen = {i for i, reached in enumerate(flags.tolist()) if reached}
            self._marked = (self._marked or set()) | chosen
        self._pending = []
        return self._marked

    def clear(self) -> None:
        self._marked, self._pending = None, []

    def __getstate__(self) -> Any:  # a pickled Fused: the outputs watched are this process's
        return {"n": self.n, "models": self.models}

    def __setstate__(self, state: Any) -> None:
        self.__init__(state["n"])  # type: ignore[misc]
        self._marked = state["models"]

    def watch(self, output: Any, split: Callable[[Any], List[Any]]) -> Any:
        """`output`, a forward's, its tensors hooked: a backward through one that was never
        unpacked marks every model; through one unpacked, the models whose part of its gradient
        (as `split`, the module's unpack, parts the output) is not zero."""
        record = _Output()
        for t in _with_grad(output):
            self._outputs[t] = record
            _hook(t, self._marking(range(self.n), unless=record))
            _hook(t, self._by_gradient(output, t, split, record))
        return output

    def _by_gradient(
        self, output: Any, wide: torch.Tensor, split: Callable[[Any], List[Any]], record: _Output
    ) -> Callable[[Any], None]:
        def mark(grad: Any) -> None:
            # every model already marked by its part's hook (which runs before the whole tensor's
            # gradient is summed): nothing to add. Splitting the gradient made a 16-trial MLP
            # sweep's training step 2.6 ms slower of 17 ms (one thread, hidden 64)
            if grad is None or not record.unpacked or (self._marked is not None and len(self._marked) == self.n):
                return
            leaves, structure = trees.flat(output)
            swapped = [
                grad if leaf is wide else torch.zeros_like(leaf) if isinstance(leaf, torch.Tensor) else leaf
                for leaf in leaves
            ]
            try:
                parts = split(trees.unflat(swapped, structure))
            except (RuntimeError, ValueError, TypeError, IndexError):  # a layout a gradient does not split by
                self._marked = set(range(self.n))  # every model, as before the record
                return
            nothing = torch.zeros((), dtype=torch.bool, device=grad.device)
            self._pending.append(
                torch.stack([_any_nonzero(trees.tensors(part), nothing) for part in parts])
            )

        return mark

    def each(self, output: Any, outputs: List[Any]) -> List[Any]:
        """`outputs`, the N models' of `output`, each model's tensors hooked to mark it."""
        for t in _with_grad(output):
            record = self._outputs.get(t)  # type: ignore[no-untyped-call]
            if record is not None:
                record.unpacked = True
        for i, out in enumerate(outputs):
            for t in _with_grad(out):
                _hook(t, self._marking([i]))
        return outputs

    def _marking(self, models: Iterable[int], unless: Optional[_Output] = None) -> Callable[[Any], None]:
        chosen = list(models)

        def mark(grad: Any) -> None:
            # None: the backward of a node of several outputs (unbind, chunk) reached another of them
            if grad is None or (unless is not None and unless.unpacked):
                return
            self._marked = (self._marked or set()) | set(chosen)

        return mark


def _any_nonzero(tensors: List[torch.Tensor], nothing: torch.Tensor) -> torch.Tensor:
    """Whether any of `tensors` holds a value that is not zero, as a bool tensor on their device."""
    flags = [t.ne(0).any() for t in tensors]
    return torch.stack(flags).any() if flags else nothing


def _with_grad(tree: Any) -> List[torch.Tensor]:
    """The tensors of `tree` a backward can reach."""
    if not torch.is_grad_enabled():
        return []
    return [t for t in trees.tensors(tree) if t.requires_grad]


def _hook(t: torch.Tensor, fn: Callable[[Any], None]) -> None:
    t.register_hook(fn)  # type: ignore[no-untyped-call]
