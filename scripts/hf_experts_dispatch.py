"""The "wide_tessera" experts implementation, driven by a tuned table, against each transformers
implementation at every shape the table measured.

    wide_tessera tune hf_experts --preset quick --device cpu --table TABLE
    taskset -c 1 python scripts/hf_experts_dispatch.py TABLE [--budget S]

For each hf_experts entry of TABLE measured on this device: that family's experts module at the
entry's sizes, N experts, on a routing drawn as the op draws it (the entry's top_k and skew),
called as a transformers MoE block calls it (hidden states, top_k index, top_k weights).
Times eager, every transformers implementation that runs here, and "wide_tessera" in interleaved
rounds (measurement.timing, one thread; one ten times slower than eager in rounds of its own),
and prints per shape each one's median, wide_tessera's speedup over the best of transformers'
with its 95% interval (core.stats.paired_ratio), and what wide_tessera chose there and why.
Every implementation's output is checked against eager's.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from wide_tessera.core.environment import capture_environment  # noqa: E402
from wide_tessera.core.job import DTYPES  # noqa: E402
from wide_tessera.core.stats import paired_ratio  # noqa: E402
from wide_tessera.dispatch.table import DispatchTable  # noqa: E402
from wide_tessera.integrations import transformers as integration  # noqa: E402
from wide_tessera.measurement.timing import TimingConfig, measure_paired  # noqa: E402
from wide_tessera.ops.hf_experts import build_experts, hf_implementations, router_choice  # noqa: E402
from wide_tessera.reports.text import format_table  # noqa: E402


def measure_shape(dispatch, names, entry, n, budget_s):
    """One row: the shape, each implementation's median ms, what wide_tessera chose, its speedups."""
    torch.manual_seed(0)
    p, dtype = entry.params, DTYPES[entry.dtype]
    experts = build_experts(p["model_type"], n, p["hidden"], p["intermediate"]).to(dtype)
    index, weights = router_choice(p["tokens"], n, p["top_k"], p["skew"])
    call = (torch.randn(p["tokens"], p["hidden"], dtype=dtype), index, weights.to(dtype))
    shape = f"{p['model_type']} N={n} tokens={p['tokens']} top_k={p['top_k']} {p['hidden']}x{p['intermediate']}"
    timed, skipped, seconds = {}, [], {}
    with torch.no_grad():
        reference = integration.implementation("eager")(experts, *call)
        for impl in [*names, integration.NAME]:
            run = dispatch if impl == integration.NAME else integration.implementation(impl)
            try:
                run(experts, *call)  # the first call: a decision, a workspace
                started = time.perf_counter()
                out = run(experts, *call)
                seconds[impl] = time.perf_counter() - started
            except Exception as e:  # noqa: BLE001  an implementation that does not run here (a hub kernel)
                skipped.append(f"{impl} ({type(e).__name__})")
                continue
            torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)
            timed[impl] = partial(run, experts, *call)
        # Interleaved rounds keep the functions' cyclic order, so the one after an implementation 50
        # times slower than eager (batched_mm at prefill, gathering 67 MB of weights) always ran on the
        # caches it left: wide_tessera measured 0.88x of the very grouped_mm it ran. Those run apart.
        slow = {k for k in timed if seconds[k] > 10 * seconds["eager"]}
        stats = {}
        for group in ({k: f for k, f in timed.items() if k not in slow}, *({k: timed[k]} for k in slow)):
            stats.update(measure_paired(group, "cpu", TimingConfig(budget_s=budget_s)).stats)
    if skipped:
        print(f"{shape}: did not run here: {', '.join(skipped)}", file=sys.stderr)
    samples = {k: s.samples_ms for k, s in stats.items()}
    best = min((k for k in samples if k != integration.NAME), key=lambda k: stats[k].median_ms)
    ratio, low, high = paired_ratio(samples[best], samples[integration.NAME])
    default = paired_ratio(samples[integration.DEFAULT], samples[integration.NAME])[0]
    bucket = integration.token_bucket(p["tokens"])
    mine = [v for k, v in dispatch.chosen.items() if k[0] is type(experts) and k[1][0] == n and k[2] == bucket]
    chosen, why = mine[0]
    return [
        shape, *(f"{stats[k].median_ms:.3f}" if k in stats else "-" for k in [*names, integration.NAME]),
        chosen, f"{ratio:.2f}x [{low:.2f},{high:.2f}] {best}", f"{default:.2f}x", why,
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of sampling per implementation and shape")
    args = parser.parse_args()
    torch.set_num_threads(1)
    name = capture_environment("cpu").device_name
    entries = [e for e in DispatchTable.load(args.table).entries if e.op == "hf_experts" and e.device_name == name]
    dispatch = integration.register(table=args.table)
    names = ["eager", *hf_implementations()]
    rows = [measure_shape(dispatch, names, e, v.n, args.budget) for e in entries for v in e.verdicts]
    header = [
        "shape", *(f"{k} ms" for k in [*names, integration.NAME]), "wide_tessera chose",
        "wide_tessera vs best transformers [95% CI]", f"vs default {integration.DEFAULT}", "why",
    ]  # fmt: skip
    print(f"{name}, torch {torch.__version__}, 1 thread, table {args.table}")
    print(format_table(header, rows))


if __name__ == "__main__":
    main()
