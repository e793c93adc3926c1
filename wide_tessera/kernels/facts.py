"""What Triton made of a kernel: compile time, registers, spills, shared memory, warps, stages, the autotuner's
choice, the IR.

Read from Triton's own objects after the kernels ran: a JIT function's compiled
kernels (`device_caches[device][0]`, a dict of CompiledKernel in triton 3.x), each
with `n_regs` and `n_spills` (set when the binary is loaded), `metadata` (shared,
num_warps, num_stages, name) and `asm` (the IR of every stage: ttir, ttgir, llir,
ptx, cubin); and an Autotuner's `cache` (tuning key -> chosen Config),
`configs_timings` (Config -> ms) and `bench_time` (seconds), both of its last tuning.
Compile times are clocked while the kernels run (CompileClock). Under the interpreter
nothing is compiled and there is no IR: `dump_ir` says so in the directory it writes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..core.files import make_folder

__all__ = [
    "KernelFacts",
    "AutotuneFacts",
    "CompileClock",
    "compiled_kernels",
    "kernel_facts",
    "autotune_facts",
    "dump_ir",
]

IR_STAGES = ("ttir", "ttgir", "llir", "ptx")


@dataclass(frozen=True)
class KernelFacts:
    """One compiled kernel: registers per thread, spilled registers, shared memory bytes, warps,
    stages, and the seconds its compilation took in this process where a CompileClock saw it."""

    name: str
    registers: Optional[int]
    spills: Optional[int]
    shared_bytes: Optional[int]
    num_warps: Optional[int]
    num_stages: Optional[int]
    compile_s: Optional[float] = None


@dataclass(frozen=True)
class AutotuneFacts:
    """One tuning of an autotuned kernel: the key it was tuned for, the config chosen, every
    config tried with its time in ms (empty when only one config was offered) and the seconds
    the tuning took (known for the last tuning only, as the times are)."""

    kernel: str
    key: str
    chosen: Dict[str, Any]
    tried: List[Dict[str, Any]]
    tuning_s: Optional[float] = None


class CompileClock:
    """Seconds each specialization of a Triton kernel took to compile in this process.

    Triton calls `knobs.runtime.jit_cache_hook` just before it compiles a specialization and
    `jit_post_compile_hook` just after, with the key it then caches the kernel under (triton
    3.6 and 3.9 alike). A specialization found in Triton's on-disk cache passes through both
    as well: its time is the cache load, which is what this process paid. Hooks already set
    are called as before. `with CompileClock() as clock:` around the run; `clock.of(jit, key)`.
    """

    def __init__(self) -> None:
        self.seconds: Dict[Tuple[int, Any], float] = {}
        self._started: Dict[Tuple[int, Any], float] = {}
        self._previous: Tuple[Any, Any] = (None, None)

    def __enter__(self) -> "CompileClock":
        from triton import knobs

        self._previous = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._previous

    def _before(self, **hook: Any) -> Any:
        self._started[_specialization(hook["fn"].jit_function, hook["key"])] = time.perf_counter()
        return self._previous[0](**hook) if self._previous[0] else None  # True would skip the compilation

    def _after(self, **hook: Any) -> Any:
        at = _specialization(hook["fn"].jit_function, hook["key"])
        if at in self._started:
            self.seconds[at] = time.perf_counter() - self._started.pop(at)
        return self._previous[1](**hook) if self._previous[1] else None

    def of(self, jit: Any, key: Any) -> Optional[float]:
        return self.seconds.get(_specialization(jit, key))


def _specialization(jit: Any, key: Any) -> Tuple[int, Any]:
    """A compiled specialization's identity: its JIT function and the key triton caches it under."""
    return id(jit), key


def _jit_of(kernel: Any) -> Any:
    """The JIT function under an Autotuner (or heuristics) wrapper."""
    while hasattr(kernel, "fn") and not hasattr(kernel, "device_caches"):
        kernel = kernel.fn
    return kernel


def compiled_kernels(kernel: Any) -> Iterator[Tuple[Any, Any]]:
    """(key, CompiledKernel) for every specialization a JIT function (or an autotuned one) has
    compiled, on every device."""
    for entry in getattr(_jit_of(kernel), "device_caches", {}).values():
        yield from entry[0].items()  # the kernel cache comes first in every triton 3.x version


def kernel_facts(compiled: Any, compile_s: Optional[float] = None) -> KernelFacts:
    meta = getattr(compiled, "metadata", None)
    return KernelFacts(
        name=str(getattr(meta, "name", getattr(compiled, "name", "?"))),
        registers=getattr(compiled, "n_regs", None),
        spills=getattr(compiled, "n_spills", None),
        shared_bytes=getattr(meta, "shared", None),
        num_warps=getattr(meta, "num_warps", None),
        num_stages=getattr(meta, "num_stages", None),
        compile_s=compile_s,
    )


def _config(config: Any) -> Dict[str, Any]:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def autotune_facts(autotuner: Any, name: str) -> List[AutotuneFacts]:
    """The tunings an Autotuner has made. Triton keeps the timings of the last tuning only."""
    timings = getattr(autotuner, "configs_timings", None) or {}
    facts = []
    for key, chosen in getattr(autotuner, "cache", {}).items():
        last = chosen in timings  # the tuning whose times triton kept
        tried = [{**_config(c), "ms": _first(ms)} for c, ms in timings.items()] if last else []
        facts.append(
            AutotuneFacts(
                name, str(key), _config(chosen), tried, getattr(autotuner, "bench_time", None) if last else None
            )
        )
    return facts


def _first(ms: Any) -> float:
    # do_bench gives one number, or a list of quantiles
    return float(ms[0] if isinstance(ms, (list, tuple)) else ms)


def dump_ir(kernels: Dict[str, Any], directory: Path, clock: Optional[CompileClock] = None) -> List[Path]:
    """Write each compiled kernel's IR (NAME.K.ttir/.ttgir/.llir/.ptx) and facts.json into `directory`.

    `kernels`: name -> a JIT or autotuned kernel. A kernel that compiled nothing (it did
    not run, or ran in the interpreter) is named in README.txt with the reason. `clock`:
    the CompileClock that ran while they compiled, for their compile times.
    """
    make_folder(directory, "IR folder")
    written, facts, idle = [], [], []
    for name, kernel in kernels.items():
        found = list(compiled_kernels(kernel))
        if not found:
            idle.append(name)
        for i, (key, compiled) in enumerate(found):
            compile_s = clock.of(_jit_of(kernel), key) if clock is not None else None
            facts.append({"kernel": name, **asdict(kernel_facts(compiled, compile_s))})
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
            "No IR for: "
            + ", ".join(idle)
            + ".\nThey compiled nothing in this process: they did not run, ran in worker processes "
            "(--isolate), or ran in Triton's interpreter (TRITON_INTERPRET=1), which executes the Python source in "
            "numpy and has no TTIR, TTGIR, LLIR or PTX.\n"
        )
        written.append(directory / "README.txt")
    return written
