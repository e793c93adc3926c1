"""One command for whoever has a GPU: everything in wide_tessera that needs one, in one report.

    python scripts/gpu_check.py [-o DIR] [--preset quick] [--budget S] [--deadline S]

1. the Triton kernels against torch at large sizes, and transformers' experts implementations
   (grouped_mm, batched_mm, eager) against our Triton grouped GEMM in bfloat16 at decode and
   prefill sizes (hf_experts), and N LoRA adapters over one base (the lora op's strategies, its
   Triton segmented shrink and expand among them): median, paired speedup CI, TFLOP/s,
   percentage of the roofline bound (peaks calibrated on this device), kernels launched
   per call, and energy per call and power from NVML's energy counter (measurement.energy);
2. the GPU tests (pytest -m gpu);
3. the timer fidelity against triton's do_bench (scripts/timer_fidelity.py);
4. `benchmark --all --preset P --device cuda` plain, with --cuda-graph and with
   --compile default; the result files and logs go to DIR.

Prints one report at the end. Every step has a time limit within --deadline (8 minutes
by default), so the report comes even when a sweep is cut short; the sampling budget per
function of step 4 is shortened to --budget seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from wide_tessera import load_results  # noqa: E402
from wide_tessera.reports.text import format_table  # noqa: E402


def step(title: str, argv: List[str], log: Path, timeout_s: float) -> List[str]:
    """Run one command; its output goes to `log`; returns its report row (title, exit, last line, seconds)."""
    print(f"== {title}: {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    try:
        # the scripts import wide_tessera from this checkout, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"{e.stdout or ''}{e.stderr or ''}\nstopped after {timeout_s:.0f} s"
    log.write_text(out if isinstance(out, str) else out.decode())
    last = "\n".join(str(out).strip().splitlines()[-1:])
    return [title, str(rc), last, f"{time.perf_counter() - started:.0f}"]


def sweep_rows(path: Path, mode: str) -> List[List[str]]:
    if not path.exists():
        return [[mode, "-", "no results written", "", "", "", ""]]
    rows = []
    for r in load_results(path):
        rows.append(
            [
                mode,
                r.op,
                "RELIABLE" if r.reliable else "UNRELIABLE",
                "yes" if r.all_correct else f"NO ({len(r.failures)})",
                str(r.crossover_n),
                "-" if r.best_speedup is None else f"{r.best_speedup:.2f}x",
                f"{r.duration_s:.0f}",
            ]
        )
    return rows


def kernel_cases() -> List[Tuple[str, str, Dict[str, Callable[[], object]], float, float, str]]:
    """(name, dtype, {side: fn}, flops, min bytes, reference side) at the sizes the issue names."""
    from wide_tessera.kernels import flash_attention, grouped_linear, ragged_linear
    from wide_tessera.ops.experts import routing_sizes

    dev, bf16 = "cuda", torch.bfloat16
    cases = []
    n, tokens, d = 8, 4096, 4096
    x = torch.randn(n, tokens, d, device=dev, dtype=bf16)
    w, b = torch.randn(n, d, d, device=dev, dtype=bf16) / 64, torch.randn(n, d, device=dev, dtype=bf16)
    wt = w.transpose(1, 2)
    cases.append(
        (
            f"grouped GEMM N={n} {tokens} tokens {d}x{d}, uniform",
            "bfloat16",
            {
                "bmm": lambda: torch.baddbmm(b.unsqueeze(1), x, wt),
                "triton": lambda: grouped_linear(x, w, b),  # TMA on Hopper and later
                "triton, pointer loads": lambda: grouped_linear(x, w, b, tma=False),
            },
            2.0 * n * tokens * d * d,
            2.0 * (x.numel() + w.numel() + b.numel() + x.numel()),
            "bmm",
        )
    )
    for skew in (1.0, 2.0):
        sizes = routing_sizes(n, n * tokens, skew)
        flat = torch.randn(sum(sizes), d, device=dev, dtype=bf16)
        groups = torch.tensor(sizes, device=dev, dtype=torch.int32)
        offsets = groups.cumsum(0, dtype=torch.int32)
        largest = max(sizes)
        rows = torch.cat([torch.arange(s) + g * largest for g, s in enumerate(sizes)]).to(dev)

        def padded(flat=flat, rows=rows, largest=largest) -> torch.Tensor:
            xp = flat.new_zeros(n * largest, d).index_copy_(0, rows, flat).view(n, largest, d)
            return torch.baddbmm(b.unsqueeze(1), xp, wt).view(-1, d)[rows]

        sides = {"padded": padded, "triton": lambda flat=flat, groups=groups: ragged_linear(flat, w, groups, b)}
        if hasattr(torch, "_grouped_mm"):
            sides["grouped_mm"] = lambda flat=flat, offsets=offsets: torch._grouped_mm(flat, wt, offs=offsets)
        cases.append(
            (
                f"ragged GEMM N={n} skew {skew} (largest group {largest} of {sum(sizes)} tokens)",
                "bfloat16",
                sides,
                2.0 * sum(sizes) * d * d,
                2.0 * (2 * flat.numel() + w.numel()),
                "padded",
            )
        )
    cases += hf_experts_cases()
    cases += lora_cases()
    # contiguous q, k, v; then, as the flash_attention op lays them, strided views of one
    # [Z, L, 3, H, D] projection, which both sides read where they lie
    for length, views in ((2048, False), (4096, False), (2048, True)):
        z, h, hd = 4 * 4, 16, 64  # N=4 models, batch 4, folded into Z
        if views:
            q, k, v = torch.randn(z, length, 3, h, hd, device=dev, dtype=bf16).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = (torch.randn(z, h, length, hd, device=dev, dtype=bf16) for _ in range(3))
        cases.append(
            (
                f"flash attention Z=16 (N=4 x B=4) H={h} L={length} D={hd} "
                f"causal{', projection views' if views else ''}",
                "bfloat16",
                {
                    "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    "triton": lambda q=q, k=k, v=v: flash_attention(q, k, v, causal=True),  # pointer loads
                    "triton, TMA": lambda q=q, k=k, v=v: flash_attention(q, k, v, causal=True, tma=None),
                },
                4.0 * z * h * length * length * hd / 2,
                2.0 * 4 * q.numel(),
                "sdpa",
            )
        )
    return cases


def hf_experts_cases() -> List[Tuple[str, str, Dict[str, Callable[[], object]], float, float, str]]:
    """transformers' experts (Qwen2-MoE's sizes: 60 experts of hidden 2048, intermediate 1408, top 4)
    in bfloat16, called as its MoE block calls them, at decode and prefill sizes: transformers'
    grouped_mm (its default, the reference), batched_mm and eager against our Triton ragged grouped
    GEMM and our other strategies as experts implementations (ops.hf_experts.experts_forward)."""
    if importlib.util.find_spec("transformers") is None:
        print("hf_experts: transformers is not installed; its cases are left out", flush=True)
        return []
    from wide_tessera.core.capabilities import unmet_need
    from wide_tessera.integrations.transformers import implementation
    from wide_tessera.ops.hf_experts import WideHFExperts, build_experts, router_choice

    dev, bf16 = "cuda", torch.bfloat16
    n, hidden, inter, top_k = 60, 2048, 1408, 4
    experts = build_experts("qwen2_moe", n, hidden, inter).to(device=dev, dtype=bf16)
    cases = []
    for tokens in (1, 8, 512, 4096):
        torch.manual_seed(0)
        index, weights = router_choice(tokens, n, top_k, 0.0)
        call = (torch.randn(tokens, hidden, device=dev, dtype=bf16), index.to(dev), weights.to(dev, bf16))
        names = ["grouped_mm", "eager", "triton", "padded", "foreach_mm"]
        # batched_mm gathers both weight matrices for every routed row: 3 x hidden x inter x 2 bytes each
        if tokens * top_k * 3 * hidden * inter * 2 < 8 * 2**30:
            names.insert(1, "batched_mm")
        # what this torch lacks is left out, as a sweep skips it (torch 2.11 has no _foreach_mm)
        params = dict(model_type="qwen2_moe", hidden=hidden, intermediate=inter)
        names = [s for s in names if not unmet_need(WideHFExperts.STRATEGY_NEEDS.get(s), dev, bf16, params)]
        sides = {name: partial(implementation(name), experts, *call) for name in names}
        rows = tokens * top_k
        cases.append(
            (
                f"hf_experts qwen2_moe N={n} {tokens} tokens top_k={top_k} {hidden}x{inter} "
                f"({'decode' if tokens <= 8 else 'prefill'})",
                "bfloat16",
                sides,
                6.0 * rows * hidden * inter,
                2.0 * (3 * n * hidden * inter + 2 * tokens * hidden),
                "grouped_mm",
            )
        )
    return cases


def lora_cases() -> List[Tuple[str, str, Dict[str, Callable[[], object]], float, float, str]]:
    """N=16 LoRA adapters of rank 16 over one 4096x4096 base in bfloat16, 256 tokens each on
    average, uniform and ragged (the lora op's splits): the N separate calls (the reference)
    against every strategy of the op that runs here, the Triton segmented shrink and expand
    among them (inference)."""
    from wide_tessera.core.capabilities import unmet_need
    from wide_tessera.ops.experts import routing_sizes
    from wide_tessera.ops.lora import SPLITS, WideLoRA

    dev, bf16 = "cuda", torch.bfloat16
    n, hidden, rank, tokens = 16, 4096, 16, 256
    torch.manual_seed(0)
    models = [WideLoRA.bench_model(hidden=hidden, rank=rank).to(device=dev, dtype=bf16) for _ in range(n)]
    for m in models:  # inference: no graph kept for a backward
        m.eval().requires_grad_(False)
    cases = []
    for split, skew in SPLITS.items():
        inputs = [torch.randn(s, hidden, device=dev, dtype=bf16) for s in routing_sizes(n, n * tokens, skew)]
        params = dict(hidden=hidden, rank=rank, split=split)
        sides: Dict[str, Callable[[], object]] = {
            "N calls": lambda inputs=inputs: [m(x) for m, x in zip(models, inputs)]
        }
        for strategy in WideLoRA.BENCHMARK_STRATEGIES:
            if unmet_need(WideLoRA.STRATEGY_NEEDS.get(strategy), dev, bf16, params) is None:
                wide = WideLoRA.from_modules(models, strategy)
                packed = wide.pack(inputs)
                sides[strategy] = partial(wide, packed)
        t = n * tokens
        cases.append(
            (
                f"lora N={n} rank {rank} over one {hidden}x{hidden} base, {tokens} tokens each, {split}",
                "bfloat16",
                sides,
                2.0 * t * hidden * (hidden + 2 * rank),
                2.0 * (2 * t * hidden + hidden * hidden + n * 2 * rank * hidden),
                "N calls",
            )
        )
    return cases


def kernel_rows() -> List[List[str]]:
    from wide_tessera.core.job import Work
    from wide_tessera.core.stats import paired_ratio
    from wide_tessera.measurement.energy import EnergyUnavailable, measure_energy
    from wide_tessera.measurement.launches import count_launches
    from wide_tessera.measurement.roofline import load_or_calibrate, roofline
    from wide_tessera.measurement.timing import TimingConfig, measure_paired

    peaks = load_or_calibrate("cuda")
    print(
        "peaks:",
        {k: round(v) for k, v in peaks.tflops.items()},
        f"TFLOP/s, copy {peaks.copy_gbps:.0f} GB/s",
        flush=True,
    )
    rows = []
    for name, dtype, sides, flops, min_bytes, reference in kernel_cases():
        try:
            timed = measure_paired(sides, "cuda", TimingConfig(budget_s=1.0, target_rel_ci=0.01))
        except Exception as e:  # noqa: BLE001  one case's failure is a row of the report
            rows.append([name, "ERROR", f"{type(e).__name__}: {str(e)[:120]}", "", "", "", "", ""])
            continue
        base = timed.stats[reference]
        try:  # windows of 0.5 s, half the runner's, to keep the table within its step's time limit
            energy = measure_energy(sides, {s: st.median_ms for s, st in timed.stats.items()}, "cuda", window_s=0.5)
        except EnergyUnavailable as e:
            print(f"{name}: no energy measured ({e})", flush=True)
            energy = {}
        for side, st in timed.stats.items():
            ratio, low, high = paired_ratio(base.samples_ms, st.samples_ms)
            roof = roofline(Work(flops, min_bytes), st.median_ms, peaks, dtype)
            rows.append(
                [
                    name,
                    side,
                    f"{st.median_ms:.4g}",
                    f"{ratio:.2f}x [{low:.2f},{high:.2f}]",
                    f"{roof.tflops:.0f}",
                    f"{roof.percent_of_bound:.0f}% ({roof.bound})",
                    f"{count_launches(sides[side], 'cuda'):g}",
                    f"{energy[side].mj_per_call:.4g} ({energy[side].watts:.0f} W)" if side in energy else "-",
                ]
            )
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--out", default="gpu_check_out", help="directory for logs and result files")
    parser.add_argument("--preset", default="quick", help="preset of the sweeps of step 3")
    parser.add_argument("--budget", type=float, default=0.2, help="sampling seconds per function in step 3")
    parser.add_argument(
        "--deadline", type=float, default=480, help="seconds for everything; later steps get what is left"
    )
    parser.add_argument("--kernels-only", action="store_true", help="print only the kernel table (step 1)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; this script is for a machine with one")
    if args.kernels_only:
        header = [
            "case",
            "side",
            "median ms",
            "speedup",
            "TFLOP/s",
            "of roofline bound",
            "launches/call",
            "mJ/call (W)",
        ]
        print(format_table(header, kernel_rows()))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def left(most: float) -> float:
        return max(10.0, min(most, args.deadline - (time.perf_counter() - started) - 15))

    py = sys.executable
    # The kernel table first, as a process of its own: its CUDA context, alive beside the sweeps,
    # made every sweep's GPU "busy" with one other process (H100 run, 2026-11-22).
    kernels_log = out / "kernels.log"
    steps = [step("kernel table", [py, __file__, "--kernels-only"], kernels_log, left(200))]
    tests = [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    steps.append(step("GPU tests", tests, out / "tests.log", left(150)))
    steps.append(
        step("timer fidelity", [py, "scripts/timer_fidelity.py", "--device", "cuda"], out / "fidelity.log", left(90))
    )
    sweeps = []
    for mode, extra in (("plain", []), ("cuda graph", ["--cuda-graph"]), ("compile default", ["--compile", "default"])):
        path = out / f"sweep_{mode.replace(' ', '_')}.json"
        argv = [py, "-m", "wide_tessera", "benchmark", "--all", "--preset", args.preset, "--device", "cuda"]
        argv += ["--budget", str(args.budget), "--quiet", "-o", str(path), *extra]
        steps.append(step(f"{args.preset} sweep, {mode}", argv, out / f"sweep_{mode.replace(' ', '_')}.log", left(300)))
        sweeps += sweep_rows(path, mode)

    print(f"\n#### gpu_check on {torch.cuda.get_device_name()}, torch {torch.__version__}: "
          f"{time.perf_counter() - started:.0f} s in all")
    print(format_table(["step", "exit", "last line", "s"], steps))
    print("\ntimer fidelity (the runner's CUDA timer against do_bench):")
    print((out / "fidelity.log").read_text().strip()[-2500:])
    print(f"\n{args.preset} sweeps of every op (a sweep cut off by the deadline keeps the points it measured):")
    print(format_table(["mode", "op", "verdict", "all correct", "crossover N", "best speedup", "s"], sweeps))
    print("\nTriton kernels against torch (speedup: reference median / this median, paired 95% CI):")
    print(kernels_log.read_text().strip())


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
