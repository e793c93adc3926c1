"""How fast is one training step of N models fused, each with its own learning rate?

N 3-layer MLPs (Linear d->h, ReLU, Linear h->h, ReLU, Linear h->d; batch B), one training step
each: the N inputs stacked, forward, one MSE loss per model summed, backward, Adam step,
zero_grad. Timed in one interleaved run (paired rounds), each ratio against the loop with its
95% CI:

    loop         N models, each stepped by its own torch.optim.Adam (its own lr): the baseline
    torch.func   torch.func's ensembling: stack_module_state + vmap(functional_call), one
                 torch.optim.Adam over the stacked parameters (ONE lr for all: per-model
                 settings cannot be expressed there)
    wt vmap      wide_tessera.fuse(strategy='vmap') stepped by wide_tessera.optim.Adam, per-model lr
    wt surgery   wide_tessera.fuse(strategy='surgery') stepped by wide_tessera.optim.Adam, per-model lr

Before timing, each fused side takes a step beside the separate trainings and is checked against
them (core.correctness.check_trained, Adam's tolerance): one step, as later steps carry rounding
across ReLU boundaries here (vmap at N=32 flipped a unit of 2 of 32 models within 5 steps, its
gradients within 6e-7 of the loop's before); `--mode train` and scripts/trained_check.py check
10 steps against a rounding twin. Pin it for quotable numbers:

    taskset -c 1 python scripts/train_speed.py [--n-values 8,32] [--hidden 256] [--batch 256] [--budget 2]
"""

from __future__ import annotations

import argparse
import copy
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

import wide_tessera as wt
import wide_tessera.optim as wto
from wide_tessera.core.correctness import ADAM_TRAINED, check_trained
from wide_tessera.core.stats import paired_ratio
from wide_tessera.measurement.timing import TimingConfig, measure_paired
from wide_tessera.reports.text import format_table


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def kernel(implementation: Optional[str]) -> Dict[str, bool]:
    """torch's Adam in the implementation asked for (None: torch's default for the device)."""
    return {} if implementation is None else {implementation: True}


def loop_step(models: List[nn.Module], lrs: List[float], xs, ys, implementation=None) -> Callable[[], None]:
    optimizers = [torch.optim.Adam(m.parameters(), lr=lr, **kernel(implementation)) for m, lr in zip(models, lrs)]

    def step() -> None:
        sum(F.mse_loss(m(x), y) for m, x, y in zip(models, xs, ys)).backward()
        for o in optimizers:
            o.step()
            o.zero_grad()

    return step


def func_step(models: List[nn.Module], lr: float, xs, ys, implementation=None) -> Callable[[], None]:
    params, buffers = stack_module_state(models)
    params = {k: nn.Parameter(v.detach()) for k, v in params.items()}
    skeleton = copy.deepcopy(models[0]).to("meta")
    optimizer = torch.optim.Adam(params.values(), lr=lr, **kernel(implementation))

    def one(p, b, xi):
        return functional_call(skeleton, (p, b), (xi,))

    def step() -> None:  # the inputs stacked and the losses taken per model, as on every other side
        out = vmap(one)(params, buffers, torch.stack(xs))
        sum(F.mse_loss(o, y) for o, y in zip(out.unbind(0), ys)).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def fused_step(fused: nn.Module, lrs: List[float], xs, ys, implementation=None) -> Callable[[], None]:
    optimizer = wto.Adam(fused, lr=lrs, implementation=implementation)

    def step() -> None:
        outs = fused.unpack(fused(fused.pack(xs)))
        sum(F.mse_loss(o, y) for o, y in zip(outs, ys)).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def check(strategy: str, models: List[nn.Module], lrs: List[float], xs, ys, implementation=None) -> str:
    """One step fused against one step of the separate trainings, by Adam's tolerance."""
    separate = copy.deepcopy(models)
    fused = wt.fuse(copy.deepcopy(models), strategy=strategy)
    loop_step(separate, lrs, xs, ys, implementation)()
    fused_step(fused, lrs, xs, ys, implementation)()

    def parameters(trained: List[nn.Module]) -> List[dict]:
        return [dict(m.named_parameters()) for m in trained]

    verdict = check_trained(parameters(fused.unfuse()), parameters(separate), ADAM_TRAINED)
    return "correct" if verdict.correct else f"INCORRECT: {verdict.error}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-values", default="8,32")
    parser.add_argument("--d", type=int, default=None, help="input and output width (default: --hidden)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of sampling per side")
    parser.add_argument(
        "--implementation", choices=["default", "foreach", "fused"], default="default",
        help="torch's Adam kernels on every side (default: torch's for the device, a for-loop on a CPU)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    d = args.d or args.hidden
    impl = None if args.implementation == "default" else args.implementation
    rows = []
    for n in [int(v) for v in args.n_values.split(",")]:
        torch.manual_seed(0)
        models = [MLP(d, args.hidden) for _ in range(n)]
        lrs = [10 ** (-4 + 2 * i / max(n - 1, 1)) for i in range(n)]
        xs = [torch.randn(args.batch, d) for _ in range(n)]
        ys = [torch.randn(args.batch, d) for _ in range(n)]
        checks = {s: check(s, models, lrs, xs, ys, impl) for s in ("vmap", "surgery")}
        sides: Dict[str, Callable[[], None]] = {
            "loop": loop_step(copy.deepcopy(models), lrs, xs, ys, impl),
            "torch.func": func_step(copy.deepcopy(models), lrs[0], xs, ys, impl),
            "wt vmap": fused_step(wt.fuse(copy.deepcopy(models), strategy="vmap"), lrs, xs, ys, impl),
            "wt surgery": fused_step(wt.fuse(copy.deepcopy(models), strategy="surgery"), lrs, xs, ys, impl),
        }
        stats = measure_paired(sides, "cpu", TimingConfig(budget_s=args.budget, max_samples=200)).stats
        for name in sides:
            ratio, lo, hi = paired_ratio(stats["loop"].samples_ms, stats[name].samples_ms)
            note = {"torch.func": "one lr for all"}.get(name, checks.get(name.replace("wt ", ""), "baseline"))
            rows.append([str(n), name, f"{stats[name].median_ms:.3f}", f"{ratio:.2f}x [{lo:.2f}, {hi:.2f}]", note])
    print(
        f"one Adam training step of N MLPs (d={d}, hidden={args.hidden}, batch={args.batch}), "
        f"{args.threads} thread(s), torch's {args.implementation} Adam kernels on every side, {torch.__version__}"
    )
    print(format_table(["N", "side", "median ms", "speed vs loop [95% CI]", "check / note"], rows))


if __name__ == "__main__":
    main()
