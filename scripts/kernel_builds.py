"""Every autotune config of the Triton kernels, built for a CUDA GPU on this machine, GPU or not.

For each kernel (at scripts/gpu_check.py's large bfloat16 sizes) and each target, one row
per config: registers per thread, spilled bytes, shared memory, and the tensor-core
and copy instructions in the PTX. Exit status 1 if a config does not build, spills, or needs more
shared memory than the target has. Nothing is run or timed; for what a config costs, see
gpu_check.py on a GPU.

    python scripts/kernel_builds.py [--capability 90,80]
"""

from __future__ import annotations

import argparse
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("kernel_builds.py builds the kernels: run it without TRITON_INTERPRET=1")

from wide_tessera.kernels.builds import build, large_launches  # noqa: E402
from wide_tessera.reports.text import format_table  # noqa: E402

# Shared memory one block may use (the opt-in maximum): H100 and A100.
SHARED_LIMIT = {90: 232_448, 80: 166_912}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--capability", default="90", help="compute capabilities, comma-separated: 90 (Hopper), 80 (Ampere)"
    )
    args = parser.parse_args()
    capabilities = args.capability.split(",")
    unknown = [c for c in capabilities if not c.isdigit() or int(c) not in SHARED_LIMIT]
    if unknown:
        sys.exit(f"--capability {unknown[0]!r} is not known here; valid: {', '.join(map(str, SHARED_LIMIT))}")
    capabilities = [int(c) for c in capabilities]
    rows, bad = [], 0
    for capability in capabilities:
        for name, (kernel, launch) in large_launches(capability).items():
            for b in build(kernel, launch, capability, name):
                config = " ".join(f"{k}={v}" for k, v in b.config.items())
                if b.error:
                    bad += 1
                    rows.append([f"sm_{capability}", name, config, "-", "-", "-", "-", "-", f"FAILED: {b.error}"])
                    continue
                f = b.facts
                problems = (["spills"] if f.spills else []) + (
                    ["shared memory"] if f.shared_bytes > SHARED_LIMIT[capability] else []
                )
                bad += bool(problems)
                rows.append(
                    [
                        f"sm_{capability}",
                        name,
                        config,
                        str(f.registers),
                        str(f.spills),
                        str(f.shared_bytes),
                        b.tensor_cores,
                        b.copies,
                        ", ".join(problems) or "ok",
                    ]
                )
    print(
        format_table(
            ["target", "kernel", "config", "registers", "spilled B", "shared B", "tensor cores", "copies", "verdict"],
            rows,
        )
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
