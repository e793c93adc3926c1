"""fuse(measure='first-call'): the first call measures on the real input, never chooses a wrong
strategy, keeps the winner and writes it to the table, which the next process reuses."""

import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import wide_tessera as wt
from wide_tessera import DispatchTable
from wide_tessera.dispatch.first_call import FirstCall
from wide_tessera.ops import WideLinear
from wide_tessera.ops.registry import register
from wide_tessera.widen.exported import ExportedSurgery

from .helpers import SometimesWrongLinear

ROOT = Path(__file__).resolve().parent.parent


def modules(n=16, d=64):
    torch.manual_seed(0)
    return [nn.Linear(d, d) for _ in range(n)]


def test_the_first_call_measures_chooses_the_faster_strategy_and_writes_the_table(tmp_path):
    table = tmp_path / "table.json"
    mods = modules()
    # a bound a busy machine fits in: with the default, a first call beside other work did not
    # fit, kept the loop and wrote nothing, which is what tests of the bound are for
    fused = wt.fuse(mods, table=table, measure="first-call", batch=16, time_bound_s=5.0)
    assert isinstance(fused, FirstCall) and "the first call measures" in str(fused.decision)
    xs = [torch.randn(16, 64) for _ in range(16)]
    out = fused.unpack(fused(fused.pack(xs)))
    expected = [m(x) for m, x in zip(mods, xs)]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, expected))
    # 16 small linears: bmm wins on a quiet machine, but with two threads on a busy one bmm's
    # thread barriers waited, and it measured 100x slower than the loop: the decision is the
    # entry's, whichever it is (a unit test that needs a quiet machine is a flaky one)
    (entry,) = DispatchTable.load(table).entries
    assert entry.preset == "first call" and entry.verdicts[0].n == 16
    assert fused.decision.table == str(table)  # no longer "(not written yet)"
    assert fused.decision.fused == (entry.verdicts[0].verdict == "fuse")
    assert fused.decision.strategy == (entry.verdicts[0].strategy if fused.decision.fused else None)
    again = fused.unpack(fused(fused.pack(xs)))  # the winner, without measuring again
    assert all(torch.allclose(a, b) for a, b in zip(again, out))


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x, scale):
        return self.down(torch.relu(self.up(x))) * scale


def test_the_first_call_measures_a_custom_class_like_a_built_in_op(tmp_path):
    table = tmp_path / "table.json"
    torch.manual_seed(0)
    mods = [Block() for _ in range(8)]
    fused = wt.fuse(mods, table=table, measure="first-call", time_bound_s=5.0)  # one a busy machine fits in
    assert isinstance(fused, FirstCall)
    xs = [(torch.randn(16, 32), torch.rand(1)) for _ in range(8)]
    out = fused.unpack(fused(fused.pack(xs)))
    assert all(torch.allclose(a, m(*x), atol=1e-5) for a, m, x in zip(out, mods, xs))
    (entry,) = DispatchTable.load(table).entries
    assert entry.op == "Block" and entry.params["model"] == f"{__name__}.Block" and entry.preset == "first call"
    assert entry.verdicts[0].strategy in (None, "vmap", "surgery")


def test_a_wrong_strategy_is_never_chosen(tmp_path):
    class Wrong(SometimesWrongLinear):  # 'wrong' returns zeros, 'raises' raises
        FUSES = None

    register("test_first_call_wrong")(Wrong)  # leaves with the test (conftest)
    mods = modules(n=4, d=8)
    fused = wt.fuse(mods, op="test_first_call_wrong", table=tmp_path / "t.json", measure="first-call", batch=4)
    xs = [torch.randn(4, 8) for _ in range(4)]
    out = fused.unpack(fused(fused.pack(xs)))  # 'wrong' returns zeros, far faster than anything: not chosen
    assert fused.decision.strategy != "wrong" and all(torch.allclose(a, m(x)) for a, m, x in zip(out, mods, xs))


def test_a_strategy_that_raises_only_once_timed_is_left_out_not_raised(tmp_path):
    """A strategy right on its check call that raises when timed came out of the model's forward
    as TimedFunctionError; it is now not chosen, and the others are timed without it."""

    class RaisesWhenTimed(WideLinear):
        FUSES, BENCHMARK_STRATEGIES, calls = None, ("bmm", "flaky"), 0

        def forward(self, x):
            if self.strategy == "flaky":
                RaisesWhenTimed.calls += 1
                if RaisesWhenTimed.calls > 1:  # its check call is its first
                    raise RuntimeError("kernel exploded")
            return super().forward(x)

    register("test_first_call_flaky")(RaisesWhenTimed)  # leaves with the test (conftest)
    mods = modules(n=4, d=8)
    fused = wt.fuse(mods, op="test_first_call_flaky", table=tmp_path / "t.json", measure="first-call", batch=4)
    xs = [torch.randn(4, 8) for _ in range(4)]
    out = fused.unpack(fused(fused.pack(xs)))
    assert RaisesWhenTimed.calls > 1 and fused.decision.strategy != "flaky"
    assert all(torch.allclose(a, m(x), atol=1e-6) for a, m, x in zip(out, mods, xs))


@pytest.mark.slow
def test_a_second_process_reuses_the_entry_without_measuring(tmp_path):
    table = tmp_path / "table.json"
    mods = modules()
    fused = wt.fuse(mods, table=table, measure="first-call", batch=16)
    fused(fused.pack([torch.randn(16, 64) for _ in range(16)]))
    script = (
        "import torch, wide_tessera as wt\n"
        "torch.manual_seed(0)\n"
        "mods = [torch.nn.Linear(64, 64) for _ in range(16)]\n"
        f"f = wt.fuse(mods, table={str(table)!r}, measure='first-call', batch=16)\n"
        "print(type(f.runs).__name__, f.decision.match.reason)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    kind = "LoopedModules" if not fused.decision.fused else "WideLinear"
    assert r.stdout.startswith(kind) and "FirstCall" not in r.stdout
    if fused.decision.fused:
        assert "measured on a first call" in r.stdout


def test_measure_is_one_of_its_values():
    with pytest.raises(wt.WideTesseraError, match="unknown measure 'always'"):
        wt.fuse(modules(2, 4), measure="always")


def _hold_lock(path, seconds):
    """Another process holding the table's lock for `seconds` (as a writer merging into it does)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom wide_tessera.core.files import results_lock\n"
         f"with results_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep({seconds})", str(path)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("held_s, wait_s, kept", [(0.5, 5.0, True), (60, 0.5, False)])
def test_a_first_call_waits_for_another_writer_of_the_table_and_says_so_if_the_wait_runs_out(
    held_s, wait_s, kept, tmp_path, monkeypatch
):
    """Every writer of a table holds its lock only to merge: a first call waits for it (up to
    TABLE_WAIT_S) rather than drop what it measured; a lock held past that is a warning."""
    monkeypatch.setattr("wide_tessera.dispatch.table.TABLE_WAIT_S", wait_s)
    table = tmp_path / "table.json"
    holder = _hold_lock(table, held_s)
    try:
        fused = wt.fuse(modules(4, 16), table=table, measure="first-call", time_bound_s=0.05)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fused(fused.pack([torch.randn(8, 16) for _ in range(4)]))
    finally:
        holder.kill()
        holder.communicate()
    said = [str(w.message) for w in caught if "was not written" in str(w.message)]
    if kept:
        assert not said and len(DispatchTable.load(table).entries) == 1
    else:
        assert len(said) == 1 and f"PID {holder.pid}" in said[0] and "waited 0.5 s" in said[0], said


class Slow(nn.Module):
    """A layer whose every call takes 20 ms: ten rounds of ten of them cannot be timed in 50 ms."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(0.02)
        return self.lin(x)


class FailsOnItsSecondCall(nn.Linear):
    calls = 0

    def forward(self, x):
        FailsOnItsSecondCall.calls += 1
        if FailsOnItsSecondCall.calls > 1:
            raise KeyError("called twice")
        return super().forward(x)


def first_called(mods, table, time_bound_s):
    """The first call of `mods` fused, its outputs checked against the separate calls'."""
    fused = wt.fuse(mods, table=table, measure="first-call", time_bound_s=time_bound_s)
    xs = [torch.randn(2, 8) for _ in mods]
    out = fused.unpack(fused(fused.pack(xs)))
    assert all(torch.allclose(a, m(x), atol=1e-6) for a, m, x in zip(out, mods, xs))
    return fused


def test_a_first_call_that_cannot_be_timed_within_its_bound_runs_the_loop_and_says_why(tmp_path):
    """10,000 Linears took 26.8 s against a bound of 0.5 s: a first call whose timing would take it
    past twice its bound is not measured, runs the loop, and writes nothing to the table."""
    torch.manual_seed(0)
    table = tmp_path / "table.json"
    fused = first_called([Slow() for _ in range(10)], table, 0.05)
    assert not fused.decision.fused and "not measured on its first call" in str(fused.decision)
    assert "past twice the time bound of 0.05 s" in str(fused.decision) and not table.exists()


class Untraceable(nn.Module):
    """torch.fx cannot trace len() of a proxy; torch.export captures it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * len(x)


def test_a_strategy_whose_first_call_would_pass_twice_the_bound_is_not_tried_nor_written(tmp_path, monkeypatch):
    """A model torch.export must capture took a 0.5 s first call to 1.4 s: surgery is not tried where
    the capture (what the last one took) cannot fit, the decision says so, and no entry claims the
    loop beat a strategy that never ran."""
    monkeypatch.setattr(ExportedSurgery, "capture_s", 1000.0)
    torch.manual_seed(0)
    table = tmp_path / "table.json"
    fused = first_called([Untraceable() for _ in range(4)], table, 0.5)
    assert "surgery not tried (its first call takes about 1000.0 s)" in str(fused.decision)
    assert fused.decision.strategy != "surgery" and not table.exists()


def test_on_the_meta_device_the_first_call_runs_the_loop_and_decides_on_a_real_call(tmp_path):
    """Nothing on the meta device can be timed: the measurement raised Tensor.item()'s error."""
    with torch.device("meta"):
        mods = [nn.Linear(8, 8) for _ in range(4)]
    fused = wt.fuse(mods, table=tmp_path / "table.json", measure="first-call")
    out = fused.unpack(fused(fused.pack([torch.randn(2, 8, device="meta") for _ in range(4)])))
    assert [o.shape for o in out] == [(2, 8)] * 4 and all(o.is_meta for o in out)
    assert "the first call measures" in str(fused.decision)  # still undecided


def test_a_module_that_raises_when_called_again_raises_its_own_error(tmp_path):
    """The first call calls the modules more than once to time them; what they raise then is
    theirs, of its own type (it came out as TimedFunctionError: baseline: ...)."""
    torch.manual_seed(0)
    FailsOnItsSecondCall.calls = 0
    mods = [FailsOnItsSecondCall(8, 8)]
    fused = wt.fuse(mods, measure="first-call", table=tmp_path / "table.json")
    with pytest.raises(KeyError, match="called twice"):
        fused(fused.pack([torch.randn(2, 8)]))


class Counts(nn.Module):
    """Keeps a count of its calls in a buffer it does not save, and scales by it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


def test_a_first_call_leaves_the_modules_as_the_separate_calls_leave_them(tmp_path):
    """The measurement's calls were undone for saved buffers only: a counter it does not save read
    628 after one fused call (the output 1.43 off), and gradients accumulated before were wiped."""
    torch.manual_seed(0)
    mods, twins = [Counts() for _ in range(3)], [Counts() for _ in range(3)]
    for m, t in zip(mods, twins):
        t.load_state_dict(m.state_dict())
        m.lin.weight.grad = torch.ones_like(m.lin.weight)
    fused = wt.fuse(mods, table=tmp_path / "t.json", measure="first-call")
    xs = [torch.randn(2, 8) for _ in range(3)]
    with torch.no_grad():
        out = fused.unpack(fused(fused.pack(xs)))
        want = [t(x) for t, x in zip(twins, xs)]
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    if not fused.decision.fused:  # the loop runs the modules themselves
        assert all(m.calls.item() == 1 and torch.equal(m.lin.weight.grad, torch.ones(8, 8)) for m in mods)
