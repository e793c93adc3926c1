"""Energy per call (measurement.energy): each callable is charged its own energy, not the average of all.

No GPU here, so the counter is a simulated board: it steps every `step_s` by the energy drawn
since its last step, as NVML's does (about every 100 ms on real boards), and its draw depends
on which callable is running.
"""

import math
import time

import pytest

import wide_tessera as wt
from wide_tessera.measurement import energy
from wide_tessera.measurement.energy import EnergyUnavailable, measure_energy
from wide_tessera.reports import tidy
from wide_tessera.results.load import load_results
from wide_tessera.results.schema import save_results


class Board:
    """A board that draws `idle_w` watts, or a callable's own watts while it runs."""

    def __init__(self, step_s=0.01, idle_w=50.0):
        self.step_s, self.idle_w = step_s, idle_w
        self.t0 = time.perf_counter()
        self.runs = []  # (start, end, watts, seconds asked) of every call

    def call(self, watts, seconds):
        def run():
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                pass
            self.runs.append((start, time.perf_counter(), watts, seconds))

        return run

    def mean_call_s(self, seconds):
        """How long the calls asked to spin `seconds` really took: a busy machine stretches them."""
        spans = [b - a for a, b, _, s in self.runs if s == seconds]
        return sum(spans) / len(spans)

    def energy_mj(self):
        step = self.t0 + math.floor((time.perf_counter() - self.t0) / self.step_s) * self.step_s
        joules = self.idle_w * (step - self.t0)
        joules += sum((w - self.idle_w) * max(0.0, min(b, step) - a) for a, b, w, _ in self.runs)
        return joules * 1e3


@pytest.fixture
def board(monkeypatch):
    b = Board()
    monkeypatch.setattr(energy, "open_meter", lambda device: (b, ""))
    return b


def test_each_callable_is_charged_its_own_draw(board):
    # 2 ms calls at 300 W and 100 W: 600 and 200 mJ per call. Read around interleaved timing
    # samples, a coarse counter would charge both about the same.
    fns = {"hot": board.call(300.0, 0.002), "cool": board.call(100.0, 0.0021)}
    e = measure_energy(fns, {"hot": 2.0, "cool": 2.1}, "cpu", window_s=0.2, rounds=3)
    # W x s of the calls as they ran: beside a busy process a 2 ms spin took 3.4 ms, and 600 mJ was 1014
    assert e["hot"].mj_per_call == pytest.approx(300e3 * board.mean_call_s(0.002), rel=0.15)
    assert e["cool"].mj_per_call == pytest.approx(100e3 * board.mean_call_s(0.0021), rel=0.15)
    assert e["hot"].watts == pytest.approx(300, rel=0.15) and e["cool"].watts == pytest.approx(100, rel=0.15)
    assert e["hot"].windows == 3 and e["hot"].low_mj <= e["hot"].mj_per_call <= e["hot"].high_mj


def test_a_faster_call_at_the_same_power_costs_less(board):
    fns = {"slow": board.call(200.0, 0.004), "fast": board.call(200.0, 0.001)}
    e = measure_energy(fns, {"slow": 4.0, "fast": 1.0}, "cpu", window_s=0.2, rounds=2)
    took = board.mean_call_s(0.004) / board.mean_call_s(0.001)  # 4, unless a busy machine stretched them
    assert e["slow"].mj_per_call / e["fast"].mj_per_call == pytest.approx(took, rel=0.15)


def test_a_counter_that_does_not_move_is_said_so(monkeypatch):
    class Stuck:
        def energy_mj(self):
            return 1000.0

    monkeypatch.setattr(energy, "open_meter", lambda device: (Stuck(), ""))
    monkeypatch.setattr(energy, "STEP_WAIT_S", 0.05)
    with pytest.raises(EnergyUnavailable, match="did not move"):
        measure_energy({"f": lambda: None}, {"f": 0.01}, "cpu", window_s=0.05, rounds=1)


def test_energy_unavailable_on_a_cpu_says_why():
    assert "this run is on cpu" in energy.energy_unavailable("cpu")


@pytest.mark.slow
def test_a_run_with_energy_records_it_per_callable_and_keeps_it_in_its_files(monkeypatch, fast_timing, tmp_path):
    board = Board(idle_w=100.0)  # 100 W whatever runs: a call's energy is 100 W times its time
    monkeypatch.setattr(energy, "open_meter", lambda device: (board, ""))
    monkeypatch.setattr(energy, "WINDOW_S", 0.1)
    monkeypatch.setattr(energy, "ROUNDS", 2)
    r = wt.benchmark("gemm", preset="ci", device="cpu", verbose=False, timing=fast_timing, n_values=[1, 4], energy=True)
    for p in r.points:
        assert set(p.energy) == set(p.timings)  # the baseline, every strategy that was timed
        for name, e in p.energy.items():
            assert e.watts == pytest.approx(100, rel=0.2)
            # mJ = W x ms: the energy loop's calls take about what the timer measured. Within 100x: the
            # timer throws disturbed rounds away and the energy loop cannot, so busy processes beside
            # the test made them differ by 2x, by 6.1x beside a whole CI run, and by 13x beside two
            # busy loops and the suite; a unit slip is 1000x.
            assert 0.01 < e.mj_per_call / (100 * p.timings[name]) < 100, (name, e, p.timings[name])
    assert "mJ/call (W)" in r.summary()
    path = tmp_path / "r.json"
    save_results([r], path)
    again = load_results(path)[0]
    assert again.points[0].energy == r.points[0].energy
    assert {"energy_mj", "power_w"} <= set(tidy.rows([again])[0])


def test_a_run_without_energy_shows_no_energy_column(fast_timing):
    r = wt.benchmark("gemm", preset="ci", device="cpu", verbose=False, timing=fast_timing, n_values=[1])
    assert not r.points[0].energy and "mJ/call" not in r.summary()


def test_a_damaged_energy_record_is_refused_on_load(monkeypatch, fast_timing, tmp_path):
    monkeypatch.setattr(energy, "open_meter", lambda device: (Board(), ""))
    monkeypatch.setattr(energy, "WINDOW_S", 0.05)
    monkeypatch.setattr(energy, "ROUNDS", 1)
    r = wt.benchmark("gemm", preset="ci", device="cpu", verbose=False, timing=fast_timing, n_values=[1], energy=True)
    path = tmp_path / "r.json"
    save_results([r], path)
    text = path.read_text().replace('"low_mj": ', '"low_mj": -', 1)
    path.write_text(text)
    with pytest.raises(wt.WideTesseraError, match=r"energy\['baseline'\]"):
        load_results(path)


@pytest.mark.parametrize("first,then", [(True, False), (False, True)], ids=["drops-energy", "adds-energy"])
def test_resume_refuses_to_mix_points_with_and_without_energy(monkeypatch, tmp_path, first, then):
    from click.testing import CliRunner

    from wide_tessera.cli import cli

    monkeypatch.setattr(energy, "open_meter", lambda device: (Board(), ""))
    monkeypatch.setattr(energy, "WINDOW_S", 0.05)
    monkeypatch.setattr(energy, "ROUNDS", 1)
    out = tmp_path / "r.json"
    args = ["benchmark", "gemm", "--preset", "ci", "--device", "cpu", "--budget", "0.001", "--quiet", "-o", str(out)]
    r = CliRunner().invoke(cli, [*args, "--n-values", "1", *(["--energy"] if first else [])])
    assert r.exit_code == 0, r.output
    before = out.read_text()
    r = CliRunner().invoke(cli, [*args, "--n-values", "2", "--resume", *(["--energy"] if then else [])])
    was, now = ("--energy", "no --energy") if first else ("no --energy", "--energy")
    assert r.exit_code == 2 and f"has gemm measured with {was}; this run asks for {now}" in r.output, r.output
    assert out.read_text() == before
