"""A fuzzer over real results files: every damaged file loads into a valid result or raises the one-line error.

Seeded, so a failure is reproducible; each case names the path it changed.
"""

import json
import random

import pytest

from wide_tessera import WideTesseraError, load_results
from wide_tessera.results.schema import NON_STRATEGY_WINNERS

# What a damaged field may hold instead: wrong types, impossible numbers, empty and nested things.
REPLACEMENTS = [None, True, False, 0, -1, -5.0, 1.5, 10**30, 1e308, "", "x", "faster", "baseline", [], [1, 2], {}]
N_MUTATIONS = 1200


def _places(node, path=()):
    """Every (path, value) in a decoded JSON document, containers included."""
    yield path, node
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        yield from _places(child, (*path, key))


def _mutated(doc, path, how):
    doc = json.loads(json.dumps(doc))
    *parent_path, last = path
    parent = doc
    for key in parent_path:
        parent = parent[key]
    if how == "delete":
        del parent[last]
    elif how == "rename":
        parent[f"{last}_renamed"] = parent.pop(last)
    else:
        parent[last] = how
    return doc


def _cases(doc, seed=0):
    rng = random.Random(seed)
    places = [path for path, _ in _places(doc) if path]
    for _ in range(N_MUTATIONS):
        path = rng.choice(places)
        renames = ["rename"] if isinstance(path[-1], str) else []  # list items have no name
        how = rng.choice([*REPLACEMENTS, "delete", *renames])
        yield path, how


def _assert_loads_or_refuses(path):
    try:
        results = load_results(path)
    except WideTesseraError as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return "refused"
    for r in results:  # what loads must be usable: the summary, and every property a user reads
        r.summary()
        assert isinstance(r.failures, list) and isinstance(r.warnings, list) and isinstance(r.skipped, list)
        for p in r.points:
            assert p.winner in (*NON_STRATEGY_WINNERS, *r.strategies)
            assert all(t >= 0 for t in p.timings.values())
    return "loaded"


@pytest.mark.slow
def test_single_field_mutations_load_or_raise_the_one_line_error(saved_results, tmp_path, capsys):
    doc = json.loads(saved_results.read_text())
    path = tmp_path / "mutated.json"
    outcomes = {"loaded": 0, "refused": 0}
    for where, how in _cases(doc):
        path.write_text(json.dumps(_mutated(doc, where, how)))
        try:
            outcomes[_assert_loads_or_refuses(path)] += 1
        except Exception as e:  # noqa: BLE001  reported with the mutation that caused it
            pytest.fail(f"{where} -> {how!r}: {type(e).__name__}: {e}")
    assert sum(outcomes.values()) == N_MUTATIONS >= 1000
    assert outcomes["refused"] > N_MUTATIONS / 2 and outcomes["loaded"] > 0  # the fuzzer reaches both sides
    assert capsys.readouterr().err == ""  # loading prints nothing


@pytest.mark.parametrize("seed", range(3))
def test_truncated_files_raise_the_one_line_error(saved_results, tmp_path, seed):
    text = saved_results.read_text()
    rng = random.Random(seed)
    path = tmp_path / "truncated.json"
    for cut in sorted(rng.sample(range(len(text) - 2), 40)):
        path.write_text(text[:cut])
        with pytest.raises(WideTesseraError, match="not a wide_tessera results file") as info:
            load_results(path)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        '{"schema_version": 2, "results": ' + "[" * 100000 + "]" * 100000 + "}",
        '{"schema_version": 2, "results": [' + '{"a": ' * 5000 + "1" + "}" * 5000 + "]}",
        '{"schema_version": 2, "results": [{"op": NaN}]}',
        '{"schema_version": 2, "results": [{"op": Infinity}]}',
        '{"schema_version": 2, "results": {}}',
        '{"schema_version": 2}',
        '{"schema_version": "2", "results": []}',
    ],
    ids=["deep lists", "deep objects", "NaN", "Infinity", "results object", "no results", "version string"],
)
def test_pathological_documents_raise_the_one_line_error(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(WideTesseraError) as info:
        load_results(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 500
