"""Property tests: whatever a user types as an override, the answer is a valid sweep or one clear error."""

from hypothesis import given, settings
from hypothesis import strategies as st

from wide_tessera import SweepParams, WideTesseraError
from wide_tessera.cli import parse_override

SWEEP = SweepParams.of([1, 4], batch=[8], causal=[False], dtype=["float32"], mode=["a"])
axis_names = st.sampled_from(["n_values", "batch", "causal", "dtype", "mode"]) | st.text(max_size=8)
values = st.one_of(
    st.integers(-5, 50),
    st.booleans(),
    st.text(max_size=6),
    st.floats(allow_nan=True),
    st.none(),
    st.sampled_from(["float32", "bfloat16", "float16"]),
)


@given(st.lists(st.integers(1, 10**6), min_size=1, unique=True))
def test_positive_int_lists_round_trip(xs):
    key, texts = parse_override("batch=" + ",".join(map(str, xs)))
    assert (key, texts) == ("batch", [str(x) for x in xs])
    assert SWEEP.parse_overrides({key: texts}) == {"batch": xs}
    assert SWEEP.with_overrides(batch=xs).axes["batch"] == tuple(xs)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, unique=True))
def test_a_float_axis_reads_typed_floats(xs):
    sweep = SweepParams.of([1], scale=[0.5], mode=["a"])
    texts = [repr(x) for x in xs]
    assert sweep.parse_overrides({"scale": texts}) == {"scale": xs}
    assert sweep.parse_overrides({"mode": texts}) == {"mode": texts}  # a string axis keeps the text


@settings(max_examples=300)
@given(axis_names, st.lists(st.text(max_size=6), min_size=1, max_size=4))
def test_any_typed_override_gives_a_valid_sweep_or_a_clear_error(axis, texts):
    try:
        sweep = SWEEP.with_overrides(**SWEEP.parse_overrides({axis: texts}))
    except WideTesseraError as e:
        assert "\n" not in str(e) and str(e)
        return
    new = sweep.n_values if axis == "n_values" else sweep.axes[axis]
    assert len(new) == len(texts) == len(set(new))


@given(st.text(max_size=40))
def test_any_text_parses_or_fails_cleanly(text):
    try:
        key, parsed = parse_override(text)
    except WideTesseraError as e:
        assert repr(text) in str(e)
        return
    assert key and "=" in text and len(parsed) == text.split("=", 1)[1].count(",") + 1


@settings(max_examples=300)
@given(axis_names, st.one_of(values, st.lists(values, max_size=4)))
def test_any_override_gives_a_valid_sweep_or_a_clear_error(axis, value):
    try:
        sweep = SWEEP.with_overrides(**{axis: value})
    except WideTesseraError as e:
        assert "\n" not in str(e) and str(e)  # one line, whatever the user typed
        return
    new = sweep.n_values if axis == "n_values" else sweep.axes[axis]
    assert len(new) >= 1 and len(set(new)) == len(new)
    if axis in ("n_values", "batch"):
        assert all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in new)
    if axis == "causal":
        assert all(isinstance(v, bool) for v in new)
    if axis == "dtype":
        assert set(new) <= {"float32", "bfloat16", "float16"}
