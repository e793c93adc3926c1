"""Speedups, winners, crossover and threshold on synthetic timings with known answers."""

import numpy as np

from wide_tessera import TimingStats
from wide_tessera.core.correctness import Check
from wide_tessera.core.stats import paired_ratio
from wide_tessera.measurement.health import Health
from wide_tessera.measurement.timing import PairedTimings
from wide_tessera.results import analysis, passes

from .helpers import synthetic_result as result


def samples(median_ms, spread=0.002, k=11):
    """k tightly spread samples whose median is exactly `median_ms`."""
    return [median_ms * (1 + spread * (i - k // 2)) for i in range(k)]


def point(n, params, baseline_ms, strategy_ms, correct=None, spread=0.002, health=None):
    """A PointResult from medians, each backed by a tight spread of samples."""
    correct = correct or {}
    stats = {"baseline": TimingStats.from_samples(samples(baseline_ms, spread), "synthetic")}
    stats.update({s: TimingStats.from_samples(samples(ms, spread), "synthetic") for s, ms in strategy_ms.items()})
    checks = {s: Check(correct.get(s, True), 0.0, 1e-4, None if correct.get(s, True) else "wrong") for s in strategy_ms}
    return analysis.measured_point(n, params, PairedTimings(stats, health or Health(11, 0)), checks)


def test_best_is_fastest_correct_strategy():
    p = point(4, {}, 10.0, {"a": 5.0, "b": 2.0}, correct={"b": False})
    assert p.speedups == {"a": 2.0, "b": 5.0}
    assert (p.best_strategy, p.best_speedup, p.winner) == ("a", 2.0, "a")


def test_no_correct_strategy_means_no_best():
    p = point(4, {}, 10.0, {"a": 5.0}, correct={"a": False})
    assert (p.best_strategy, p.best_speedup, p.winner) == (None, None, "baseline")


def test_slower_best_strategy_leaves_baseline_the_winner():
    p = point(2, {}, 1.0, {"a": 2.0, "b": 4.0})
    assert (p.best_strategy, p.best_speedup, p.winner) == ("a", None, "baseline")


def test_crossover_is_smallest_n_from_which_every_larger_n_wins():
    assert analysis.group_crossover([(1, False), (2, True), (4, True), (8, True)]) == 2
    assert analysis.group_crossover([(8, True), (1, False), (4, True)]) == 4  # order of points does not matter
    assert analysis.group_crossover([(1, True), (2, True)]) == 1


def test_group_that_crosses_and_falls_back_has_not_crossed_at_the_earlier_n():
    # wins at N=2 and 4, loses at 8, wins again at 16: the crossover is 16, not 2
    assert analysis.group_crossover([(1, False), (2, True), (4, True), (8, False), (16, True)]) == 16
    # falling back at the largest N means the group never crosses
    assert analysis.group_crossover([(1, False), (2, True), (4, False)]) is None


def test_overall_crossover_is_the_median_group_and_threshold_covers_every_crossing_group():
    assert analysis.overall_crossover([2, 4, 8]) == 4
    assert analysis.overall_crossover([2, None, None]) is None  # fewer than half cross
    assert analysis.overall_crossover([2, 16, None]) == 16
    assert analysis.overall_crossover([]) is None
    assert analysis.recommended_threshold([2, 16, None]) == 16
    assert analysis.recommended_threshold([None, None]) is None


def test_result_is_grouped_by_params_not_pooled():
    lucky = {"size": 1}
    unlucky = {"size": 2}
    r = result(
        [
            point(2, lucky, 10.0, {"a": 1.0, "b": 20.0}),  # lucky group wins everywhere
            point(4, lucky, 10.0, {"a": 1.0, "b": 20.0}),
            point(2, unlucky, 1.0, {"a": 2.0, "b": 3.0}),  # unlucky group never wins
            point(4, unlucky, 1.0, {"a": 2.0, "b": 3.0}),
        ]
    )
    assert [(g.params, g.crossover_n) for g in r.groups] == [(lucky, 2), (unlucky, None)]
    assert r.crossover_n == 2  # lower median of [2, inf]: half the groups cross from N=2
    assert r.recommended_threshold == 2
    assert r.strategy_wins == {"a": 2, "baseline": 2}
    assert r.best_speedup == 10.0


def test_incorrect_strategy_never_wins_nor_moves_the_crossover():
    r = result(
        [
            point(2, {}, 10.0, {"a": 20.0, "b": 1.0}, correct={"b": False}),
            point(4, {}, 10.0, {"a": 5.0, "b": 1.0}, correct={"b": False}),
        ]
    )
    assert r.crossover_n == 4
    assert "b" not in r.strategy_wins
    assert r.best_speedup == 2.0
    assert len(r.failures) == 2 and all(" b: incorrect: wrong" in f for f in r.failures)
    assert "INCORRECT" in r.summary() and "FAILED (2)" in r.summary()


def test_a_difference_within_noise_is_no_difference_not_a_win():
    p = point(4, {}, 1.0, {"a": 0.995})
    assert p.verdicts == {"a": "same"} and p.winner == "no_difference" and not p.fused_wins
    low, high = p.speedup_ci["a"]
    assert low <= p.speedups["a"] <= high


def test_equal_cost_strategy_is_never_a_winner_and_a_clearly_faster_one_always_is():
    """200 simulated noisy paired measurements of each kind, seeded."""
    rng = np.random.default_rng(0)
    equal_wins = faster_wins = 0
    for _ in range(200):
        drift = rng.lognormal(0, 0.05, 30)  # machine drift shared by both sides of a round
        base = drift * rng.lognormal(0, 0.05, 30)
        same = drift * rng.lognormal(0, 0.05, 30)
        twice_as_fast = 0.5 * drift * rng.lognormal(0, 0.05, 30)
        equal_wins += analysis.verdict(paired_ratio(base, same)[1:]) == "faster"
        faster_wins += analysis.verdict(paired_ratio(base, twice_as_fast)[1:]) == "faster"
    assert equal_wins == 0
    assert faster_wins == 200


def test_noise_cannot_create_a_crossover():
    # every strategy costs the same as the baseline: no point may win, no group may cross
    r = result([point(n, {}, 1.0, {"a": 1.0 + 0.004 * (-1) ** n, "b": 1.0}) for n in (1, 2, 4, 8)])
    assert r.crossover_n is None and r.recommended_threshold is None
    assert r.strategy_wins == {"no_difference": 4}


def test_a_speedup_inside_the_noise_is_never_a_headline():
    # conv2d once printed "443.94x [0.21,1166.89] n.s." and then "best speedup: 443.94x"
    rng = np.random.default_rng(0)
    stats = {
        "baseline": TimingStats.from_samples(10.0 * rng.lognormal(0, 3, 6), "synthetic"),
        "a": TimingStats.from_samples(0.5 * rng.lognormal(0, 3, 6), "synthetic"),
    }
    noisy = analysis.measured_point(4, {}, PairedTimings(stats, Health(6, 0)), {"a": Check(True, 0.0, 1e-4)})
    assert noisy.verdicts["a"] == "same" and noisy.best_strategy == "a" and noisy.speedups["a"] > 5
    # six rounds are too few for the decision rule's first look: undecided, and no headline
    assert noisy.best_speedup is None and noisy.winner == "open" and noisy.decision.kind == "open"
    r = result([noisy, point(8, {}, 10.0, {"a": 5.0, "b": 20.0})])
    assert r.best_speedup == 2.0
    assert "best speedup: 2.00x" in r.summary()


def test_a_significant_speedup_above_10x_is_flagged_for_a_second_look():
    p = point(4, {}, 100.0, {"a": 5.0, "b": 50.0})
    assert p.verdicts["a"] == "faster" and p.best_speedup == 20.0
    assert any("implausibly large" in f for f in p.flags)
    assert any("second look" in line for line in result([p]).summary().splitlines())
    assert not point(4, {}, 100.0, {"a": 50.0, "b": 60.0}).flags


def test_confirmation_that_disagrees_makes_the_point_unstable_and_not_a_win():
    params = {"size": 1}
    first = [point(1, params, 1.0, {"a": 1.0, "b": 2.0}), point(2, params, 2.0, {"a": 1.0, "b": 4.0})]
    assert result(first).crossover_n == 2
    # the deciding points are the crossover (N=2) and the point below it (N=1)
    assert [p.n for p in passes.points_to_confirm(first, "deciding")] == [1, 2]
    assert passes.points_to_confirm(first, "none") == []
    flipped = passes.confirmed(first[1], point(2, params, 2.0, {"a": 2.0, "b": 4.0}))
    assert flipped.unstable and flipped.winner == "unstable" and flipped.best_speedup is None
    assert not flipped.fused_wins
    r = result([first[0], flipped])
    assert r.crossover_n is None and r.recommended_threshold is None and r.best_speedup is None
    assert not r.reliable and "unstable" in r.unreliable_reasons[0]
    assert r.summary().startswith("UNRELIABLE") and "UNSTABLE" in r.summary()
    agreed = passes.confirmed(first[1], point(2, params, 2.0, {"a": 1.05, "b": 4.0}))
    assert not agreed.unstable and agreed.fused_wins and agreed.confirmation.agrees
    assert result([first[0], agreed]).crossover_n == 2
    # a confirmed point is not confirmed again; 'all' takes every unconfirmed measured point
    assert [p.n for p in passes.points_to_confirm([first[0], agreed], "all")] == [1]


def test_the_confirmation_pass_measures_decisions_not_numbers():
    params = {"size": 1}
    near = point(1, params, 1.045, {"a": 1.0, "b": 2.0})  # 1.045x: near the margin, but no crossover rests on it
    loop = point(2, params, 1.0, {"a": 1.0, "b": 2.0})
    largest = point(4, params, 1.0, {"a": 1.0, "b": 2.0})  # a group that never crosses: its largest N decides
    assert [p.n for p in passes.points_to_confirm([near, loop, largest], "deciding")] == [4]
    crossing = [point(n, params, ms, {"a": 1.0}) for n, ms in ((1, 1.0), (2, 1.0), (4, 2.0), (8, 2.0), (16, 3.0))]
    # the crossover (N=4) and the point below it: not the clear wins above
    assert [p.n for p in passes.points_to_confirm(crossing, "deciding")] == [2, 4]


def test_a_busy_machine_is_a_note_and_a_disturbed_deciding_point_a_reason():
    busy = Health(11, 3, other_load_cores=0.9, cores=2, problems=["busy machine: other processes used 0.90 of 2 cores"])
    r = result([point(2, {}, 2.0, {"a": 1.0, "b": 4.0}, health=busy)])
    assert r.reliable and "busy machine" in r.groups[0].notes[0] and "NOTES" in r.summary()
    assert r.health.points_with_problems == 1 and r.health.disturbed_rounds == 3
    disturbed = Health(
        11, 30, cleaned=False, problems=["disturbed: 30 of 41 rounds waited for a CPU or were throttled"]
    )
    r = result([point(2, {}, 2.0, {"a": 1.0, "b": 4.0}, health=disturbed)])
    assert not r.reliable and "disturbed" in r.unreliable_reasons[0]
    # the same disturbance at a point no decision rests on (far below the crossover) is a note
    points = [
        point(1, {}, 1.0, {"a": 1.0, "b": 4.0}, health=disturbed),
        point(2, {}, 1.0, {"a": 1.0}),
        point(4, {}, 2.0, {"a": 1.0}),
    ]
    r = result(points)
    assert r.reliable and r.groups[0].crossover_n == 4 and any("disturbed" in n for n in r.groups[0].notes)


def test_the_summary_digests_warnings_into_a_few_lines():
    noisy = [point(n, {"size": n}, 1.0, {"a": 0.5, "b": 2.0}, spread=0.05) for n in range(1, 30)]
    r = result(noisy)
    assert len(r.warnings) >= 29 * 3
    digest = [line for line in r.summary().splitlines() if line.startswith("WARNINGS") or line.startswith("  N=")]
    assert len(digest) <= 4 and "high spread" in digest[0] and "--warnings" in digest[0]
