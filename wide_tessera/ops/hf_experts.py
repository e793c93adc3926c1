"""The experts of a transformers mixture-of-experts family: N experts stored as 3-D tensors in the
family's class decorated with `@use_experts_implementation`, run by each implementation that
transformers' `ExpertsInterface` registers and by strategies of our own.

One model is one expert: the family's experts class built with a single expert, run by
transformers' `eager` implementation on the tokens routed to it (the baseline's N separate calls
are eager's loop over the experts). The wide layout is the routed rows sorted by expert with
their routing weights, as every implementation takes them with top_k 1: `(hidden [S, hidden],
expert ids [S, 1], weights [S, 1])`, S = tokens x top_k. Every strategy runs as a transformers
experts implementation on that call: its own sort by expert, its projections, gate and
weighting, its sum over top_k (ours through `experts_forward`, as the "wide_tessera" integration
runs them). Gathering each token's top_k rows is the router's (`route`) and not timed. Ours timed
on the sorted rows alone looked 25% faster than grouped_mm at 4 tokens where, run as the
integration runs them, they were 20% slower (mixtral, 8 experts, 128x256, one CPU thread).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import operator
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core.advice import Advice, register_advice
from ..core.capabilities import Needs
from ..core.errors import MissingDependency, WideTesseraError, one_line, unknown
from ..core.job import BenchmarkJob, SweepParams, Work
from ..core.layout import JOINED, Slot, load_joined, prefixed
from .alike import shared_config
from .base import TRITON, WideOp, itemsize
from .experts import padded_rows
from .registry import register

__all__ = [
    "HFExpert",
    "WideHFExperts",
    "experts_families",
    "build_experts",
    "route",
    "router_choice",
    "split_experts",
    "experts_sizes",
    "experts_forward",
    "OWN_STRATEGIES",
    "TRANSFORMERS_MISSING",
]

TRANSFORMERS_MISSING = "hf_experts needs transformers (pip install 'wide_tessera[transformers]')"
# Our own strategies, each a way to run the N experts' two projections over ragged groups.
OWN_STRATEGIES = ("padded", "foreach_mm", "triton")
# Config attributes that hold a family's number of experts and its experts' intermediate size
# (the first one a config has): the families name them differently.
_N_EXPERTS_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_INTERMEDIATE_ATTRS = ("moe_intermediate_size", "intermediate_size")


def _has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


@lru_cache(maxsize=1)
def hf_implementations() -> Tuple[str, ...]:
    """The names transformers' ExpertsInterface registers (grouped_mm, batched_mm, deepgemm, ...; not
    'eager', its default outside the interface),
    read from its source: importing transformers to ask would add 0.8 s to every start of
    wide_tessera (2.3 s against 1.5 s for torch alone, on our 2-core CPU)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return ()
    source = Path(spec.origin).parent / "integrations" / "moe.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_global_mapping" for t in node.targets):
            names = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
            return tuple(sorted(names, key=lambda name: name != "grouped_mm"))  # transformers' default first
    return ()


@lru_cache(maxsize=1)
def experts_families() -> Tuple[str, ...]:
    """Every transformers model type whose modeling file decorates a class with
    `@use_experts_implementation`, found in the installed sources (importing all 67 modeling
    files to ask would take half a minute)."""
    if not _has_transformers():
        return ()
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    models = Path(transformers.__file__).parent / "models"
    decorated = {
        f.parent.name for f in models.glob("*/modeling_*.py") if "@use_experts_implementation" in f.read_text()
    }
    return tuple(sorted(t for t in CONFIG_MAPPING_NAMES if model_type_to_module_name(t) in decorated))


@lru_cache(maxsize=None)
def experts_class(model_type: str) -> type:
    """The class of `model_type`'s modeling file that `@use_experts_implementation` decorated."""
    if not _has_transformers():
        raise MissingDependency(TRANSFORMERS_MISSING)
    if model_type not in experts_families():
        raise unknown("model_type (a transformers family with an experts class)", model_type, experts_families())
    import transformers.integrations.moe as moe
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    found = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if c.__module__ == module.__name__ and getattr(getattr(c, "forward", None), "__code__", None) is not None
        and c.forward.__code__.co_filename == moe.__file__  # the decorator's forward replaced the class's
    ]
    if not found:
        raise WideTesseraError(f"model_type {model_type!r}: no experts class in {module.__name__}")
    return min(found, key=lambda c: inspect.getsourcelines(c)[1])  # the first defined, where a file has several


@lru_cache(maxsize=None)
def _unbuildable(model_type: str) -> Optional[str]:
    """Why `model_type`'s experts cannot be built from its own config, or None. 49 of the 115
    families that transformers 5.24 decorates cannot: a composite model's config (qwen3_vl_moe,
    gemma4) or a sub-config of its vision or audio tower (qwen3_vl_moe_vision) holds no expert
    count, and the sweep's points failed with an AttributeError after the run had started."""
    try:
        build_experts(model_type, 2, 8, 16)
    except Exception as e:  # noqa: BLE001  whatever the family's config raises, it is the reason
        return one_line(e)[:200]
    return None


@lru_cache(maxsize=None)
def _buildable_families() -> Tuple[str, ...]:
    """The families whose experts build from their own config (8.5 s for all 115 on a 2-core CPU:
    asked only to name the valid ones in an error)."""
    return tuple(t for t in experts_families() if _unbuildable(t) is None)


def build_experts(model_type: str, n: int, hidden: int, intermediate: int) -> nn.Module:
    """`model_type`'s experts module with `n` experts of these sizes, from its config's defaults,
    initialized as transformers initializes a model (normal, std 0.02; norms by their own reset)."""
    from transformers import AutoConfig

    cls = experts_class(model_type)
    config = AutoConfig.for_model(model_type)
    config.hidden_size = hidden
    counts = [a for a in _N_EXPERTS_ATTRS if hasattr(config, a)]
    sizes = [a for a in _INTERMEDIATE_ATTRS if hasattr(config, a)]
    for attr in counts:
        setattr(config, attr, n)
    if sizes:
        setattr(config, sizes[0], intermediate)
    if isinstance(getattr(config, "num_experts_per_tok", None), int):  # some defaults leave it None
        config.num_experts_per_tok = min(config.num_experts_per_tok, n)
    config._experts_implementation = "eager"
    experts = cls(config)
    got = experts_sizes(experts)
    if got != (n, hidden, intermediate):
        raise WideTesseraError(
            f"model_type {model_type!r}: {cls.__name__} built {got[0]} experts of hidden {got[1]}, intermediate "
            f"{got[2]} from a config asked for {n}, {hidden}, {intermediate}: its config names them otherwise"
        )
    with torch.no_grad():
        for m in experts.modules():
            if m is not experts and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        for p in experts.parameters(recurse=False):
            p.normal_(0.0, 0.02)
    return experts


def experts_sizes(experts: nn.Module) -> Tuple[int, int, int]:
    """(experts, hidden, intermediate) of a family's experts module, read from its down projection
    ([N, hidden, intermediate], or transposed): the families name these attributes differently."""
    n, rows, cols = experts.down_proj.shape
    return (n, cols, rows) if experts.is_transposed else (n, rows, cols)


class HFExpert(nn.Module):
    """One expert of a family: its experts class with one expert, run by transformers' eager
    implementation. forward(x [t, hidden], weights [t]) -> its weighted output [t, hidden]."""

    def __init__(self, model_type: str, hidden: int, intermediate: int):
        super().__init__()
        self.model_type, self.hidden, self.intermediate = model_type, hidden, intermediate
        self.experts = build_experts(model_type, 1, hidden, intermediate)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # eager's loop visits only the experts that received tokens
            return x.new_zeros(0, self.hidden)
        ids = torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device)
        return self.experts(x, ids, weights[:, None])


def split_experts(experts: nn.Module, model_type: str) -> List[HFExpert]:
    """The N experts of a family's experts module, each an HFExpert with a copy of its slices."""
    n, hidden, intermediate = experts_sizes(experts)
    ones = [HFExpert(model_type, hidden, intermediate) for _ in range(n)]
    ref = experts.down_proj
    with torch.no_grad():
        for name, wide in experts.state_dict().items():
            for one, part in zip(ones, JOINED.parts(wide, n)):
                one.to(device=ref.device, dtype=ref.dtype)
                operator.attrgetter(name)(one.experts).copy_(part)
    return ones


def route(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n: int
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per expert, the rows routed to it and their routing weights (a router's output made into
    the N separate calls' inputs)."""
    inputs = []
    for i in range(n):
        token, slot = torch.where(top_k_index == i)
        inputs.append((hidden_states[token], top_k_weights[token, slot]))
    return inputs


def router_choice(tokens: int, n: int, top_k: int, skew: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """A router's top_k experts per token and their weights (softmax over the top_k logits, as
    Mixtral's router). `skew` is a Zipf exponent set through the logits: expert i's logit is
    shifted by -skew ln(i + 1), so its share of the softmax falls as (i + 1) ** -skew. With fewer
    experts than top_k (a sweep refuses that: WideHFExperts.benchmark_job) every token goes to all N."""
    top_k = min(top_k, n)
    bias = -skew * torch.log(torch.arange(1, n + 1, dtype=torch.float32))
    values, index = (torch.randn(tokens, n) + bias).topk(top_k, dim=-1)
    return index, values.softmax(dim=-1)


Projection = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _projection(how: str, sizes: List[int], device: torch.device) -> Projection:
    """project(x [S, in] sorted by expert in groups of `sizes` rows, weight [N, in, out]) -> [S, out],
    group by group, for our strategy `how`; what it needs of the sizes is made once per call."""
    if how == "padded":
        rows, largest = padded_rows(sizes, device), max(sizes)

        def padded(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            n, k, out = weight.shape
            grouped = x.new_zeros(n * largest, k).index_copy(0, rows, x).view(n, largest, k)
            return torch.bmm(grouped, weight).view(-1, out)[rows]

        return padded
    if how == "foreach_mm":
        # only the experts that received rows: at decode most get none, and each empty mm is a call
        hit = [i for i, size in enumerate(sizes) if size]
        split = [sizes[i] for i in hit]

        def foreach_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return torch.cat(torch._foreach_mm(list(x.split(split)), [weight[i] for i in hit]))

        return foreach_mm
    group_sizes = torch.tensor(sizes, dtype=torch.int32, device=device)

    def triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from ..kernels import ragged_linear

        return ragged_linear(x, weight.transpose(1, 2), group_sizes)

    return triton


def _own_sorted(experts: nn.Module, how: str, x: torch.Tensor, sizes: List[int], weights: torch.Tensor) -> torch.Tensor:
    """Our strategy `how` on rows sorted by expert (`sizes` rows each): what the family's eager
    computes per expert (its gate, activation, biases, post-expert norm), over all experts at once."""
    project = _projection(how, sizes, x.device)

    def linear(h: torch.Tensor, name: str) -> torch.Tensor:
        w = getattr(experts, name)
        y = project(h, w if experts.is_transposed else w.transpose(1, 2))
        if experts.has_bias:
            group_sizes = torch.tensor(sizes, device=x.device)
            y = y + getattr(experts, f"{name}_bias").repeat_interleave(group_sizes, dim=0, output_size=h.shape[0])
        return y

    if experts.has_gate:
        h = experts._apply_gate(linear(x, "gate_up_proj"))
    else:
        h = experts.act_fn(linear(x, "up_proj"))
    y = linear(h, "down_proj")
    # transformers 5.17 (the H100 image's) has no such flag: no family there normed after the expert
    if getattr(experts, "has_post_expert_norm", False):
        y = experts.post_expert_norm(y)
    return y * weights[:, None]


def experts_forward(how: str) -> Callable[..., torch.Tensor]:
    """Our strategy `how` as a transformers experts implementation (the ExpertsInterface's
    signature): tokens sorted by expert, `how` on the groups, the top_k rows of each token summed."""

    def forward(
        experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        top_k = top_k_index.shape[-1]
        ids, order = top_k_index.reshape(-1).sort(stable=True)
        sizes = torch.bincount(ids, minlength=experts_sizes(experts)[0]).tolist()
        y = _own_sorted(experts, how, hidden_states[order // top_k], sizes, top_k_weights.reshape(-1)[order])
        out = torch.empty_like(y).index_copy_(0, order, y)
        return out.view(-1, top_k, y.shape[-1]).sum(dim=1).to(hidden_states.dtype)

    return forward


def _hf_unavailable(name: str) -> Callable[[torch.device, torch.dtype, Dict[str, Any]], Optional[str]]:
    """A probe: whether transformers' implementation `name` runs here, asked by a call on four
    tokens of the point's family and sizes (the hub kernels' own checks say Hopper only, a
    kernel not installed, a dtype: their first line is the reason)."""

    def probe(device: torch.device, dtype: torch.dtype, params: Dict[str, Any]) -> Optional[str]:
        return _hf_reason(name, str(device), dtype, params["model_type"], params["hidden"], params["intermediate"])

    return probe


@lru_cache(maxsize=None)
def _hf_reason(name: str, device: str, dtype: torch.dtype, model_type: str, hidden: int, inter: int) -> Optional[str]:
    experts = build_experts(model_type, 2, hidden, inter).to(device=device, dtype=dtype)
    experts.config._experts_implementation = name
    x = torch.randn(4, hidden, device=device, dtype=dtype)
    ids = torch.tensor([[0], [1], [1], [0]], device=device)
    try:
        experts(x, ids, torch.ones(4, 1, device=device, dtype=dtype))
    except Exception as e:  # noqa: BLE001  whatever it raises, it cannot run here
        return f"transformers' {name} does not run here ({one_line(e)[:200]})"
    return None


def _foreach_mm_unavailable(device: torch.device, dtype: torch.dtype, params: Dict[str, Any]) -> Optional[str]:
    return None if hasattr(torch, "_foreach_mm") else f"needs torch._foreach_mm, which torch {torch.__version__} lacks"


@register("hf_experts")
class WideHFExperts(WideOp, nn.Module):
    """N experts of a transformers family as one experts module, run by `strategy`: a
    transformers experts implementation (grouped_mm, batched_mm, ...) or one of ours
    (OWN_STRATEGIES: 'padded' batched matmuls over groups padded to the largest,
    'foreach_mm' torch._foreach_mm over the groups, 'triton' our ragged grouped GEMM, CUDA).
    Wide layout: pack's [rows sorted by expert, expert ids [S, 1], weights [S, 1]]."""

    # 'eager' over all N at once is what transformers runs by default for `eager`: the separate
    # calls (each expert's own eager call) pay eager's routing bookkeeping once per expert, which
    # at decode sizes a third of their time (ci preset, 4 experts, 2 tokens: eager 1.53x as fast)
    BENCHMARK_STRATEGIES = (*hf_implementations(), "eager", *OWN_STRATEGIES)
    STRATEGY_NEEDS = {
        **{name: Needs(probe=_hf_unavailable(name), probe_runs_op=True) for name in hf_implementations()},
        "foreach_mm": Needs(probe=_foreach_mm_unavailable),
        "triton": TRITON,
    }
    # Sizes of the quick preset keep batched_mm, which gathers both weight matrices for every
    # routed row, within seconds on a CPU (the issue measured 2.2 s a call at hidden 256,
    # intermediate 512 and 1024 rows); float32 only there (api drops the half types on a CPU).
    # One family in it: mixtral's and qwen2_moe's experts, built at these sizes, gave the same
    # crossovers (N=8 at 4 and at 128 tokens), winners and speedups within each other's intervals
    # (3.65x and 3.83x, 3.22x and 3.19x at N=32), and were 15.6 s of the README's 100 s run
    # (2-core CPU, quiet, 2026-11-27); the full preset keeps five families.
    BENCHMARK_SWEEPS = {
        "ci": SweepParams.of(
            [4, 8],
            model_type=["mixtral"],
            tokens=[2, 64],
            top_k=[2],
            hidden=[64],
            intermediate=[128],
            skew=[0.0, 1.5],
            dtype=["float32"],
        ),
        "quick": SweepParams.of(
            [8, 32],
            model_type=["mixtral"],
            tokens=[4, 128],
            top_k=[2],
            hidden=[128],
            intermediate=[256],
            skew=[0.0],
            dtype=["float32", "bfloat16"],
        ),
        "full": SweepParams.of(
            [8, 32, 64],
            model_type=["mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v3"],
            tokens=[1, 8, 128, 1024, 4096],
            top_k=[2, 8],
            hidden=[512, 2048],
            intermediate=[1024, 1408],
            skew=[0.0, 1.5],
            dtype=["float32", "bfloat16"],
        ),
    }

    def __init__(self, experts: nn.Module, model_type: str, strategy: Optional[str] = None):
        super().__init__()
        self.experts, self.model_type = experts, model_type
        self.strategy = self.check_strategy(strategy)
        self.sizes: List[int] = []

    @classmethod
    def check_params(cls, model_type: str, top_k: int, **params: Any) -> None:
        if not _has_transformers():
            raise MissingDependency(TRANSFORMERS_MISSING)
        experts_class(model_type)  # an unknown family is one line naming the valid ones, before measuring
        why = _unbuildable(model_type)
        if why is not None:
            raise WideTesseraError(
                f"model_type {model_type!r}: its experts cannot be built from its own config ({why}); "
                f"families whose experts build here: {', '.join(_buildable_families())}"
            )

    @classmethod
    def benchmark_job(cls, preset: str = "full", **overrides: Any) -> BenchmarkJob:
        """The op's job, refused in one line where no N of the sweep can take a top_k of it."""
        job = super().benchmark_job(preset, **overrides)
        most, top_k = max(job.sweep.n_values), max(job.sweep.axes["top_k"])
        if top_k > most:
            valid = f"give a top_k of at most {most}, or N values of at least {top_k}"
            raise WideTesseraError(f"{cls.unfit(most, top_k=top_k)}; {valid}")
        return job

    @classmethod
    def unfit(cls, n: int, **params: Any) -> Optional[str]:
        """A router cannot choose more experts than there are: the routing then sent every token to
        all N, and the point was labelled with a top_k that had not run. Such a point is skipped."""
        top_k = params["top_k"]
        return f"top_k={top_k} exceeds N={n} experts: a token is routed to at most N experts" if top_k > n else None

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module], strategy: Optional[str] = None) -> "WideHFExperts":
        config = shared_config(
            modules, HFExpert, lambda m: dict(model_type=m.model_type, hidden=m.hidden, intermediate=m.intermediate)
        )
        experts = build_experts(config["model_type"], len(modules), config["hidden"], config["intermediate"])
        return load_joined(cls(experts, config["model_type"], strategy), modules)

    def model_slots(self) -> Dict[str, Slot]:
        """The N experts side by side on every tensor's first axis, as the family holds its experts."""
        return prefixed({k: Slot(k, JOINED) for k in self.experts.state_dict()}, "experts", "experts")

    def pack(self, inputs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> List[torch.Tensor]:
        """[rows sorted by expert, their expert ids [S, 1], their weights [S, 1]]: one value, a list,
        as every fused module's forward takes one (`fused(fused.pack(inputs))`)."""
        n = experts_sizes(self.experts)[0]
        if not isinstance(inputs, (list, tuple)) or len(inputs) != n:
            raise WideTesseraError(f"pack needs a list of {n} (rows, weights) pairs, one per expert")
        self.sizes = [x.shape[0] for x, _ in inputs]
        device = inputs[0][0].device
        ids = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(self.sizes, device=device))
        return [torch.cat([x for x, _ in inputs]), ids[:, None], torch.cat([w for _, w in inputs])[:, None]]

    def unpack(self, output: torch.Tensor) -> List[torch.Tensor]:
        return list(output.split(self.sizes))

    def forward(self, packed: List[torch.Tensor]) -> torch.Tensor:
        x, ids, weights = packed
        if self.strategy in OWN_STRATEGIES:  # as the integration runs it, its own sort and sums included
            return experts_forward(self.strategy)(self.experts, x, ids, weights)
        self.experts.config._experts_implementation = self.strategy
        return self.experts(x, ids, weights)

    @classmethod
    def work(cls, n: int, tokens: int, top_k: int, hidden: int, intermediate: int, **params: Any) -> Work:
        # gated families (all the presets') project to 2 x intermediate, then back: 6 flops per weight and row
        rows = tokens * top_k
        weights = n * 3 * hidden * intermediate
        return Work(6.0 * rows * hidden * intermediate, float((2 * rows * hidden + weights) * itemsize(params)))

    @classmethod
    def bench_model(cls, model_type: str, hidden: int, intermediate: int, **_: Any) -> nn.Module:
        return HFExpert(model_type, hidden, intermediate)

    @classmethod
    def bench_inputs(
        cls, n: int, tokens: int, top_k: int, hidden: int, skew: float, **_: Any
    ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        index, weights = router_choice(tokens, n, top_k, skew)
        return route(torch.randn(tokens, hidden), index, weights, n)


def _phase(params: Dict[str, Any]) -> str:
    """Decode steps route a few tokens (1 to 8 per sequence batch); anything longer is a prefill."""
    return "decode" if params["tokens"] <= 8 else "prefill"


def _implementation_name(strategy: str) -> str:
    """A strategy as a person chooses it: transformers' name, or ours through the integration."""
    return f"wide_tessera ({strategy})" if strategy in OWN_STRATEGIES else strategy


register_advice(
    "hf_experts",
    Advice(
        title="which experts_implementation to use on this machine (speedup over eager and over transformers' "
        "default grouped_mm: geometric mean of the ratios of median times over the cell's points; "
        "wide_tessera (...): register() of wide_tessera.integrations.transformers runs it)",
        rows=("model_type", "n"),
        column=_phase,
        columns=("decode", "prefill"),
        choices=WideHFExperts.BENCHMARK_STRATEGIES,
        references=("eager", "grouped_mm"),
        label=_implementation_name,
    ),
)
