"""The Triton kernels built for a CUDA GPU on a machine without one: does every config compile, and into what.

The interpreter checks what a kernel computes, never whether it compiles: a loop whose
carried type changed (int64 group sizes) passed every interpreter test and failed to
compile only on an H100. `triton.compile` builds from the source for a
named target with no device, and the ptxas that ships with triton reports registers and
spills, so CI can build every autotune config for Hopper.

Each kernel is specialized as the runtime specializes a launch of scripts/gpu_check.py's
large cases: pointers 16-byte aligned (as torch allocates), integers equal to 1 made
constants and multiples of 16 marked so. Without those marks the build is not the one a
GPU runs: a plain matmul got one shared-memory buffer and no asynchronous copies, with
them three buffers (147,456 bytes) and wgmma.

Run it in a process without TRITON_INTERPRET=1: under the interpreter the kernels are
Python functions, not compilable ones.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas  # the ptxas triton itself builds this target with
from triton.compiler import ASTSource

from .facts import KernelFacts

__all__ = ["Build", "build", "large_launches"]


@dataclass(frozen=True)
class Build:
    """One config of one kernel built for a target: its facts, or the error that stopped it."""

    kernel: str
    config: Dict[str, Any]
    facts: Optional[KernelFacts]
    # the tensor-core instruction in its PTX: "wgmma" (Hopper), "mma" (Ampere and later), "none"
    tensor_cores: Optional[str]
    # how tiles reach shared memory: "tma" (Hopper's copy engine), "cp.async" (asynchronous
    # copies, Ampere and later), "none" (through registers: no software pipelining)
    copies: Optional[str]
    error: Optional[str]


def large_launches(capability: int = 90) -> Dict[str, Tuple[Any, Dict[str, Any]]]:
    """Each kernel a GPU of `capability` launches, with the arguments of one large bfloat16
    launch (scripts/gpu_check.py's sizes): integers as values, pointers as their element
    type, TMA descriptors as functions of the config (their block is its tile)."""
    from .attention import ATTENTION, ATTENTION_TMA
    from .grouped_gemm import GROUPED, GROUPED_TMA, RAGGED

    n, rows, d = 8, 4096, 4096
    pointers = {name: "*bf16" for name in ("x", "w", "bias", "y")}
    common = dict(O=d, K=d, swn=d * d, swo=d, swk=1, sbn=d, HAS_BIAS=True, PRECISION=None)
    grouped = dict(pointers, M=rows, sxn=rows * d, sxm=d, sxk=1, syn=rows * d, sym=d, syo=1, **common)
    # skewed routing: a token count that no tile size divides
    ragged = dict(pointers, sizes="*i64", T=n * rows + 5, N=n, sxt=d, sxk=1, syt=d, syo=1, **common)
    h, length, dim = 16, 2048, 64  # the batch of models and samples is the grid's, not an argument
    strides = dict(z=h * length * dim, h=length * dim, l=dim, d=1)
    attention = {name: "*bf16" for name in ("q", "k", "v", "o")}
    attention.update({f"s{t}{axis}": s for t in "qkvo" for axis, s in strides.items()})
    attention.update(H=h, L=length, scale=dim**-0.5, D=dim, CAUSAL=True, PRECISION=None, TMA=False)
    launches = {
        "grouped_linear": (GROUPED, grouped),
        "ragged_linear": (RAGGED, ragged),
        "flash_attention": (ATTENTION, attention),
    }
    if capability >= 90:  # the copy engine (TMA) is Hopper's
        descriptors = dict(
            x=lambda v: f"tensordesc<bf16[1, {v['BM']}, {v['BK']}]>",
            w=lambda v: f"tensordesc<bf16[1, {v['BO']}, {v['BK']}]>",
            y=lambda v: f"tensordesc<bf16[1, {v['BM']}, {v['BO']}]>",
        )
        tma = dict(
            descriptors, bias="*bf16", M=rows, N=n, PROGRAMS=132, **common
        )  # common's strides go unread: the descriptors carry them
        launches["grouped_linear_tma"] = (GROUPED_TMA, tma)  # H100 SXM: 132 SMs, a program each
        rows_block = lambda v: f"tensordesc<bf16[1, 1, {v['BM']}, {dim}]>"  # noqa: E731
        keys_block = lambda v: f"tensordesc<bf16[1, 1, {v['BN']}, {dim}]>"  # noqa: E731
        attention_tma = dict(attention, q=rows_block, o=rows_block, k=keys_block, v=keys_block, TMA=True)
        launches["flash_attention_tma"] = (ATTENTION_TMA, attention_tma)
    return launches


def build(kernel: Any, args: Dict[str, Any], capability: int = 90, name: Optional[str] = None) -> List[Build]:
    """Build every autotune config of `kernel` (autotuned, with heuristics, or a plain JIT
    function) for CUDA compute capability `capability`, specialized for `args`."""
    jit, configs, heuristics = _layers(kernel)
    name = name or jit.__name__
    builds = []
    for config in configs:
        values = {**args, **config.kwargs}
        for arg, rule in [*heuristics.items(), *((a, v) for a, v in args.items() if callable(v))]:
            values[arg] = rule(values)
        described = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
        try:
            compiled = triton.compile(
                _source(jit, values),
                target=GPUTarget("cuda", capability, 32),
                options={"num_warps": config.num_warps, "num_stages": config.num_stages},
            )
        except Exception as e:  # noqa: BLE001  a failed build is the finding, reported with its config
            builds.append(Build(name, described, None, None, None, f"{type(e).__name__}: {e}".splitlines()[0]))
            continue
        ptx = compiled.asm["ptx"]
        registers, spills = _ptxas_usage(ptx, capability)
        facts = KernelFacts(
            compiled.metadata.name, registers, spills, compiled.metadata.shared, config.num_warps, config.num_stages
        )
        cores = "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else "none"
        copies = "tma" if "cp.async.bulk.tensor" in ptx else "cp.async" if "cp.async" in ptx else "none"
        builds.append(Build(name, described, facts, cores, copies, None))
    return builds


def _layers(kernel: Any) -> Tuple[Any, List[Any], Dict[str, Any]]:
    """The JIT function under `kernel`, its autotune configs (one default for a plain
    kernel) and its heuristics (argument -> rule)."""
    configs, heuristics = None, {}
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        if not hasattr(kernel, "fn"):
            raise TypeError(f"{kernel!r} is not a Triton kernel (run without TRITON_INTERPRET=1)")
        configs = configs or getattr(kernel, "configs", None)
        heuristics.update(getattr(kernel, "values", None) or {})
        kernel = kernel.fn
    return kernel, configs or [triton.Config({})], heuristics


def _source(jit: Any, values: Dict[str, Any]) -> ASTSource:
    """The kernel specialized for `values` as the runtime would specialize such a launch."""
    signature, constants, attrs = {}, {}, {}
    for i, (arg, param) in enumerate(zip(jit.arg_names, jit.params)):
        if arg not in values:
            raise KeyError(f"no value for argument {arg!r} of {jit.__name__}")
        value = values[arg]
        if param.is_constexpr or value == 1 and isinstance(value, int) and not isinstance(value, bool):
            signature[arg], constants[arg] = "constexpr", value
        elif isinstance(value, str) and value.startswith("tensordesc"):
            signature[arg] = value
        elif isinstance(value, str):  # a pointer, aligned as torch's allocations are
            signature[arg], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=jit, signature=signature, constexprs=constants, attrs=attrs)


def _ptxas_usage(ptx: str, capability: int) -> Tuple[Optional[int], Optional[int]]:
    """Registers per thread and spilled bytes, from `ptxas -v`. Not the ptxas of
    triton.knobs: triton 3.9 writes PTX 9.4 for Hopper, which that one (PTX 8.8) refused."""
    arch = f"sm_{capability}{'a' if capability == 90 else ''}"  # triton builds Hopper as sm_90a
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        report = subprocess.run(
            [get_ptxas(capability).path, "-v", "--gpu-name", arch, str(source), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return (int(registers.group(1)) if registers else None, int(spills.group(1)) if spills else None)
