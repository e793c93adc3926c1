"""The Triton kernels build for Hopper on a machine without a GPU (wide_tessera.kernels.builds).

Each test builds in a child process without TRITON_INTERPRET=1, which conftest sets for
this one: interpreted kernels are Python functions, not compilable ones.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="needs triton with its CUDA backend (pip install triton)",
)

H100_SHARED_BYTES = 232_448


def builds_in_child(code: str, path: str = "") -> list:
    """What `code` (which sets `builds` to a list of Build) found, as dicts."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = f"import sys, json, dataclasses\nsys.path.insert(0, {path!r})\n{textwrap.dedent(code)}\n"
    script += "print(json.dumps([dataclasses.asdict(b) for b in builds]))\n"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_every_config_of_every_kernel_builds_for_hopper_without_spilling():
    builds = builds_in_child(
        """
        from wide_tessera.kernels.builds import build, large_launches
        builds = [b for name, (k, args) in large_launches().items() for b in build(k, args, 90, name)]
        """
    )
    assert {b["kernel"] for b in builds} == {
        "grouped_linear",
        "grouped_linear_tma",
        "ragged_linear",
        "flash_attention",
        "flash_attention_tma",
    }
    for b in builds:
        where = f"{b['kernel']} {b['config']}"
        assert b["error"] is None, where
        assert b["facts"]["registers"] > 0 and b["facts"]["spills"] == 0, where
        assert 0 < b["facts"]["shared_bytes"] <= H100_SHARED_BYTES, where
        # tiles of 64 rows and more are what Hopper's warp-group MMA is for
        assert b["tensor_cores"] == ("wgmma" if b["config"]["BM"] >= 64 else "mma"), where
        # tiles come by the copy engine where a kernel has descriptors, else by asynchronous copies
        assert b["copies"] == ("tma" if b["kernel"].endswith("_tma") else "cp.async"), where


@pytest.mark.slow
def test_an_ampere_build_has_no_tma_kernel():
    builds = builds_in_child(
        """
        from wide_tessera.kernels.builds import build, large_launches
        builds = [b for name, (k, args) in large_launches(80).items() for b in build(k, args, 80, name)[:1]]
        """
    )
    assert {b["kernel"] for b in builds} == {"grouped_linear", "ragged_linear", "flash_attention"}
    assert all(b["error"] is None and b["copies"] == "cp.async" for b in builds)


@pytest.mark.slow
def test_the_build_is_specialized_as_a_launch_is():
    """With the runtime's alignment marks the GEMM's loads are pipelined: a buffer per stage
    (without them: one buffer, no asynchronous copies)."""
    (big,) = builds_in_child(
        """
        from wide_tessera.kernels.builds import build, large_launches
        kernel, args = large_launches()["grouped_linear"]
        builds = [b for b in build(kernel, args, 90) if b.config["BO"] == 256]
        """
    )
    c = big["config"]
    stage_bytes = (c["BM"] * c["BK"] + c["BK"] * c["BO"]) * 2  # bfloat16 tiles of x and W
    assert big["facts"]["shared_bytes"] == c["num_stages"] * stage_bytes


def test_a_kernel_that_does_not_compile_is_a_failed_build_with_its_error(tmp_path):
    (tmp_path / "broken.py").write_text(
        textwrap.dedent(
            """
            import triton
            import triton.language as tl

            @triton.jit
            def broken(x, BLOCK: tl.constexpr):
                a = tl.load(x + tl.arange(0, BLOCK))
                b = tl.load(x + tl.arange(0, 2 * BLOCK))
                tl.store(x + tl.arange(0, BLOCK), a + b)  # shapes BLOCK and 2 * BLOCK
            """
        )
    )
    (failed,) = builds_in_child(
        """
        from broken import broken
        from wide_tessera.kernels.builds import build
        builds = build(broken, {"x": "*fp32", "BLOCK": 16}, 90)
        """,
        str(tmp_path),
    )
    assert failed["kernel"] == "broken" and failed["facts"] is None
    assert failed["error"].startswith("CompilationError")
