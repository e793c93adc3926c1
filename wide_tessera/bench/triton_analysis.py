"""What Triton made of a kernel: registers, spills, shared memory, warps, stages, the autotuner's choice, the IR.

Read from Triton's own objects after the kernels ran: a JIT function's compiled
kernels (`device_caches[device][0]`, a dict of CompiledKernel in triton 3.x), each
with `n_regs` and `n_spills` (set when the binary is loaded), `metadata` (shared,
num_warps, num_stages, name) and `asm` (the IR of every stage: ttir, ttgir, llir,
ptx, cubin); and an Autotuner's `cache` (tuning key -> chosen Config) and
`configs_timings` (Config -> ms, from its last tuning). Under the interpreter nothing
is compiled and there is no IR: `dump_ir` says so in the directory it writes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

__all__ = ["KernelFacts", "AutotuneFacts", "compiled_kernels", "kernel_facts", "autotune_facts", "dump_ir"]

IR_STAGES = ("ttir", "ttgir", "llir", "ptx")


@dataclass(frozen=True)
class KernelFacts:
    """One compiled kernel: registers per thread, spilled registers, shared memory bytes, warps, stages."""

    name: str
    registers: Optional[int]
    spills: Optional[int]
    shared_bytes: Optional[int]
    num_warps: Optional[int]
    num_stages: Optional[int]


@dataclass(frozen=True)
class AutotuneFacts:
    """One tuning of an autotuned kernel: the key it was tuned for, the config chosen, and
    every config tried with its time in ms (empty when only one config was offered)."""

    kernel: str
    key: str
    chosen: Dict[str, Any]
    tried: List[Dict[str, Any]]


def _jit_of(kernel: Any) -> Any:
    """The JIT function under an Autotuner (or heuristics) wrapper."""
    while hasattr(kernel, "fn") and not hasattr(kernel, "device_caches"):
        kernel = kernel.fn
    return kernel


def compiled_kernels(kernel: Any) -> Iterator[Any]:
    """Every CompiledKernel a JIT function (or an autotuned one) has made, on every device."""
    for entry in getattr(_jit_of(kernel), "device_caches", {}).values():
        yield from entry[0].values()  # the kernel cache comes first in every triton 3.x version


def kernel_facts(compiled: Any) -> KernelFacts:
    meta = getattr(compiled, "metadata", None)
    return KernelFacts(
        name=str(getattr(meta, "name", getattr(compiled, "name", "?"))),
        registers=getattr(compiled, "n_regs", None),
        spills=getattr(compiled, "n_spills", None),
        shared_bytes=getattr(meta, "shared", None),
        num_warps=getattr(meta, "num_warps", None),
        num_stages=getattr(meta, "num_stages", None),
    )


def _config(config: Any) -> Dict[str, Any]:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def autotune_facts(autotuner: Any, name: str) -> List[AutotuneFacts]:
    """The tunings an Autotuner has made. Triton keeps the timings of the last tuning only."""
    timings = getattr(autotuner, "configs_timings", None) or {}
    facts = []
    for key, chosen in getattr(autotuner, "cache", {}).items():
        tried = [{**_config(c), "ms": _first(ms)} for c, ms in timings.items()] if chosen in timings else []
        facts.append(AutotuneFacts(name, str(key), _config(chosen), tried))
    return facts


def _first(ms: Any) -> float:
    # do_bench gives one number, or a list of quantiles
    return float(ms[0] if isinstance(ms, (list, tuple)) else ms)


def dump_ir(kernels: Dict[str, Any], directory: Path) -> List[Path]:
    """Write each compiled kernel's IR (NAME.K.ttir/.ttgir/.llir/.ptx) and facts.json into `directory`.

    `kernels`: name -> a JIT or autotuned kernel. A kernel that compiled nothing (it did
    not run, or ran in the interpreter) is named in README.txt with the reason.
    """
    directory.mkdir(parents=True, exist_ok=True)
    written, facts, idle = [], [], []
    for name, kernel in kernels.items():
        found = list(compiled_kernels(kernel))
        if not found:
            idle.append(name)
        for i, compiled in enumerate(found):
            facts.append({"kernel": name, **asdict(kernel_facts(compiled))})
            for stage in IR_STAGES:
                text = getattr(compiled, "asm", {}).get(stage)
                if text is not None:
                    path = directory / f"{name}.{i}.{stage}"
                    path.write_text(text if isinstance(text, str) else text.decode())
                    written.append(path)
        facts += [{"kernel": name, "autotune": asdict(a)} for a in autotune_facts(kernel, name)]
    (directory / "facts.json").write_text(json.dumps(facts, indent=1) + "\n")
    written.append(directory / "facts.json")
    if idle:
        (directory / "README.txt").write_text(
            "No IR for: " + ", ".join(idle) + ".\nThey compiled nothing in this process: they did not run, "
            "or ran in Triton's interpreter (TRITON_INTERPRET=1), which executes the Python source in "
            "numpy and has no TTIR, TTGIR, LLIR or PTX.\n"
        )
        written.append(directory / "README.txt")
    return written
