"""A transformers experts implementation, "wide_tessera", that runs each MoE layer's call with the
implementation this machine measured fastest for that call's shape.

    from wide_tessera.integrations.transformers import register
    register()                                   # the table `wide_tessera tune hf_experts` wrote
    model.set_experts_implementation("wide_tessera")

A call's shape is its family, number of experts, tokens (bucketed to the next power of two, so
decode and prefill are looked up apart), top_k, hidden and intermediate sizes, dtype and device.
Its implementation is read from the dispatch table once per shape, by the table's own rule
(`dispatch.table.match`): the winning strategy where fusing was measured to win, transformers'
`eager` where the separate calls did as well, transformers' default where the measurement was not
conclusive (a disturbed machine, say). Every later call of the shape is one dict lookup.
No entry: with measure="first-call" the call is measured on its real input (`dispatch.first_call`,
every strategy checked against eager) and the entry written to the table for the next process;
else transformers' default implementation, with one warning naming the `tune` command.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Tuple, Union

import torch
from torch import nn

from ..core.environment import capture_environment
from ..core.errors import MissingDependency, WideTesseraError, unknown
from ..core.user_input import check_number
from ..dispatch.build import op_trials
from ..dispatch.first_call import FirstCall
from ..dispatch.fuse import DispatchWarning, tune_command
from ..dispatch.table import LOOP_VERDICTS, Case, DispatchTable, Match, decide, default_table_path
from ..ops.hf_experts import (
    OWN_STRATEGIES,
    TRANSFORMERS_MISSING,
    WideHFExperts,
    experts_forward,
    experts_sizes,
    route,
    split_experts,
)

__all__ = ["register", "ExpertsDispatch", "NAME", "DEFAULT"]

NAME = "wide_tessera"
# What transformers runs when a model names no experts implementation
# (PreTrainedModel.get_correct_experts_implementation, transformers 5.24).
DEFAULT = "grouped_mm"
MEASURES = ("table", "first-call")

Key = Tuple[Any, ...]


def token_bucket(tokens: int) -> int:
    """The power of two at or above `tokens`: decode's 1 to 8 tokens and prefill's hundreds fall apart."""
    return 1 << max(tokens - 1, 0).bit_length()


class ExpertsDispatch:
    """The "wide_tessera" experts implementation: called as transformers calls one,
    `(experts, hidden_states, top_k_index, top_k_weights)`. `chosen` holds, per shape met, the
    implementation's name and why."""

    def __init__(self, table: Union[None, str, Path, DispatchTable], measure: str, time_bound_s: float):
        if measure not in MEASURES:
            raise unknown("measure", measure, MEASURES)
        check_number("time_bound_s", time_bound_s, 0, 3600, what="a number of seconds")
        self.measure, self.time_bound_s = measure, time_bound_s
        if isinstance(table, DispatchTable):
            self.table, self.path = table, None
        elif table is None or isinstance(table, (str, Path)):
            self.path = str(table if table is not None else default_table_path())
            self.table = DispatchTable.load(self.path) if Path(self.path).exists() else DispatchTable()
        else:
            raise WideTesseraError(f"register: table={table!r}: give a path or a DispatchTable")
        self.chosen: Dict[Key, Tuple[str, str]] = {}
        self._index: Dict[Key, Callable[..., torch.Tensor]] = {}
        self._warned = False

    def __call__(
        self, experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        key = (
            type(experts), experts.down_proj.shape, token_bucket(hidden_states.shape[0]), top_k_index.shape[-1],
            hidden_states.dtype, hidden_states.device,
        )  # fmt: skip
        run = self._index.get(key)
        if run is None:
            run = self._index[key] = self._decide(key, experts, hidden_states, top_k_index, top_k_weights)
        return run(experts, hidden_states, top_k_index, top_k_weights)

    def _decide(self, key: Key, experts: nn.Module, *call: torch.Tensor) -> Callable[..., torch.Tensor]:
        case = _case(experts, *call)
        trials = op_trials(WideHFExperts)
        answer = decide(self.table, case, trials.strategies, trials.needs, str(call[0].device))
        if answer.entries:
            name, why = _measured_choice(answer)
        elif self.measure == "first-call":
            name, why = _measured_choice(self._first_call(case, experts, *call))  # as the next process reads it
        else:
            name, why = DEFAULT, "no measured entry: transformers' default"
            self._warn_untuned(case)
        self.chosen[key] = (name, why)
        return implementation(name)

    def _first_call(self, case: Case, experts: nn.Module, *call: torch.Tensor) -> Match:
        """Measure the separate calls against every strategy on this call's routed rows, checked
        against them, and write the entry (dispatch.first_call); the answer is also kept in the
        in-memory table, for the other layers of this shape."""
        if call[0].device.type == "meta":  # routing reads the token ids: torch's NotImplementedError for nonzero
            raise WideTesseraError(
                f"the {NAME} experts implementation measures its first call, and these experts are on the meta "
                "device: load their weights first (from_pretrained, or to_empty and load_state_dict)"
            )
        experts_n = split_experts(experts, case.params["model_type"])
        first = FirstCall(experts_n, op_trials(WideHFExperts), case, self.path, self.time_bound_s, self.path)
        first(first.pack(route(*call, case.n)))
        return first.decision.match

    def _warn_untuned(self, case: Case) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"the {NAME} experts implementation has no measured entry for {case.params} x{case.n} experts "
            f"(dtype={case.dtype}) on {case.device_name} in {self.path or 'the table given'}: running transformers' "
            f"default {DEFAULT!r} where nothing is measured. Measure it with: {tune_command(case, [case.n])}",
            DispatchWarning,
            stacklevel=4,
        )


def _measured_choice(answer: Match) -> Tuple[str, str]:
    """What a table's answer runs: its strategy where fusing won (and can run here); eager where
    the separate calls were measured as fast (eager is their loop over the experts); else, where
    the measurement was not conclusive (disturbed, open, unstable, unconfirmed) or its winner
    cannot run here, transformers' default."""
    if answer.fuse and answer.strategy is not None:
        return answer.strategy, answer.reason
    verdicts = {v.verdict for e in answer.entries for v in e.verdicts if v.n == answer.measured_n}
    if verdicts and verdicts <= set(LOOP_VERDICTS):
        return "eager", answer.reason
    return DEFAULT, f"{answer.reason}: no conclusive answer that runs here, transformers' default"


def _case(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> Case:
    device = hidden_states.device
    n, hidden, intermediate = experts_sizes(experts)
    return Case(
        op=WideHFExperts.NAME,
        device=device.type,
        device_name=capture_environment(str(device)).device_name,
        dtype=str(hidden_states.dtype).replace("torch.", ""),
        mode="inference",
        compile="none",
        cuda_graph=False,
        params=dict(
            model_type=experts.config.model_type,
            tokens=token_bucket(hidden_states.shape[0]),
            top_k=top_k_index.shape[-1],
            hidden=hidden,
            intermediate=intermediate,
        ),
        n=n,
    )


def implementation(name: str) -> Callable[..., torch.Tensor]:
    """The experts forward of strategy `name`: transformers' eager (the class's own forward), one of
    the implementations its ExpertsInterface registers, or one of ours."""
    if name in OWN_STRATEGIES:
        return experts_forward(name)
    if name == "eager":
        return lambda experts, *call: type(experts).forward.__wrapped__(experts, *call)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if name not in ALL_EXPERTS_FUNCTIONS:  # a table written by another version: KeyError said only the name
        raise unknown(
            "experts implementation in the dispatch table", name, [*OWN_STRATEGIES, "eager", *ALL_EXPERTS_FUNCTIONS]
        )
    return ALL_EXPERTS_FUNCTIONS[name]


def register(
    table: Union[None, str, Path, DispatchTable] = None, measure: str = "table", time_bound_s: float = 0.5
) -> ExpertsDispatch:
    """Register the experts implementation "wide_tessera" with transformers' ExpertsInterface;
    then `model.set_experts_implementation("wide_tessera")`.

    table: a path or a DispatchTable; default $WIDE_TESSERA_DISPATCH, else the per-user cache file
    `wide_tessera tune hf_experts` writes. measure: 'table' (a shape with no entry runs
    transformers' default, with one warning) or 'first-call' (it is measured on its first call
    within `time_bound_s` and written to the table file). Returns the implementation: its `chosen`
    says what each shape met runs, and why.
    """
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        raise MissingDependency(TRANSFORMERS_MISSING) from None
    dispatch = ExpertsDispatch(table, measure, time_bound_s)
    ExpertsInterface.register(NAME, dispatch)
    return dispatch
