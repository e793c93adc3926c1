"""hf_experts over transformers' experts classes, and the 'wide_tessera' experts implementation."""

import json
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from wide_tessera import benchmark  # noqa: E402
from wide_tessera.core.errors import WideTesseraError  # noqa: E402
from wide_tessera.dispatch.table import DispatchTable  # noqa: E402
from wide_tessera.integrations import transformers as integration  # noqa: E402
from wide_tessera.ops.hf_experts import (  # noqa: E402
    OWN_STRATEGIES,
    WideHFExperts,
    build_experts,
    experts_families,
    experts_forward,
    route,
    split_experts,
)

from .helpers import entry  # noqa: E402

# Each family stands for a layout: mixtral (gate and up concatenated), qwen2_moe (its own intermediate
# size attribute), gpt_oss (transposed, biases, interleaved gate and up, a clamped gate of its own).
FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "gpt_oss"]
RUNS_ON_CPU = ["grouped_mm", "batched_mm", "eager", "padded", "foreach_mm"]


def _call(n=8, tokens=6, top_k=2, hidden=32, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(tokens, hidden)
    index = torch.stack([torch.randperm(n)[:top_k] for _ in range(tokens)])
    return x, index, torch.rand(tokens, top_k).softmax(-1)


def test_families_are_found_in_the_installed_transformers_not_listed_by_us():
    families = experts_families()
    assert {"mixtral", "qwen2_moe", "olmoe", "gpt_oss", "deepseek_v3"} <= set(families)
    assert "llama" not in families  # no experts class


def test_an_unknown_model_type_is_one_line_naming_the_valid_ones_before_measuring():
    with pytest.raises(WideTesseraError, match="model_type.*'nope'.*mixtral"):
        WideHFExperts.benchmark_job("ci", model_type=["nope"])


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("strategy", RUNS_ON_CPU)
def test_every_strategy_equals_the_separate_eager_calls(model_type, strategy):
    torch.manual_seed(0)
    n = 8
    modules = [WideHFExperts.bench_model(model_type, hidden=32, intermediate=48) for _ in range(n)]
    inputs = WideHFExperts.bench_inputs(n, tokens=6, top_k=2, hidden=32, skew=1.0)
    assert any(x.shape[0] == 0 for x, _ in inputs)  # an expert with no tokens, as routers leave them
    reference = [m(x, w) for m, (x, w) in zip(modules, inputs)]
    wide = WideHFExperts.from_modules(modules, strategy)
    got = wide.unpack(wide(wide.pack(inputs)))
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_skew_is_set_through_the_router_logits():
    counts = [x.shape[0] for x, _ in WideHFExperts.bench_inputs(8, 512, 2, 16, skew=2.0)]
    uniform = [x.shape[0] for x, _ in WideHFExperts.bench_inputs(8, 512, 2, 16, skew=0.0)]
    assert counts[0] > 3 * counts[-1] and max(uniform) < 2 * min(uniform)
    assert sum(counts) == 512 * 2


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("how", ["padded", "foreach_mm"])
def test_our_strategies_as_transformers_implementations_equal_eager(model_type, how):
    torch.manual_seed(0)
    experts = build_experts(model_type, 8, 32, 48)
    call = _call()
    eager = type(experts).forward.__wrapped__(experts, *call)
    torch.testing.assert_close(experts_forward(how)(experts, *call), eager, rtol=1e-5, atol=1e-6)


def test_experts_built_by_a_transformers_without_the_post_expert_norm_flag_are_served():
    # transformers 5.17 (the GPU image's) sets no has_post_expert_norm on its experts; our
    # implementations raised AttributeError there on every call (H100 run, 2026-11-27)
    torch.manual_seed(0)
    experts = build_experts("qwen2_moe", 8, 32, 48)
    del experts.has_post_expert_norm
    call = _call()
    eager = type(experts).forward.__wrapped__(experts, *call)
    torch.testing.assert_close(experts_forward("padded")(experts, *call), eager, rtol=1e-5, atol=1e-6)


def test_split_experts_and_route_are_the_separate_calls_of_the_whole_module():
    torch.manual_seed(0)
    experts = build_experts("olmoe", 8, 32, 48)
    x, index, weights = _call()
    parts = [m(*inp) for m, inp in zip(split_experts(experts, "olmoe"), route(x, index, weights, 8))]
    total = torch.zeros_like(x)
    for i, part in enumerate(parts):
        token, _ = torch.where(index == i)
        total.index_add_(0, token, part)
    torch.testing.assert_close(total, type(experts).forward.__wrapped__(experts, x, index, weights))


def _tiny_model(model_type):
    config = AutoConfig.for_model(
        model_type, hidden_size=32, intermediate_size=48, moe_intermediate_size=48, shared_expert_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64, num_local_experts=8,
        num_experts=8, num_experts_per_tok=2, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _generate(model, implementation):
    model.set_experts_implementation(implementation)
    torch.manual_seed(1)
    prompt = torch.randint(1, 64, (1, 10))
    return model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe"])
@pytest.mark.slow
def test_generate_gives_eagers_tokens_with_what_the_first_call_measured(model_type, tmp_path):
    table = tmp_path / "dispatch.json"
    # a bound a busy machine's first call can time the separate calls in (with 0.05 s, a loaded
    # run judged the timing past twice the bound, and wrote no entry: as it should; with 0.5 s,
    # beside two busy loops and the suite, the 10-token prompt's)
    dispatch = integration.register(table=str(table), measure="first-call", time_bound_s=5.0)
    model = _tiny_model(model_type)
    expected = _generate(model, "eager")
    assert torch.equal(_generate(model, "wide_tessera"), expected)
    why = {key[2]: reason for key, (_, reason) in dispatch.chosen.items()}
    assert set(why) == {1, 16}  # decode and the 10-token prompt, looked up apart
    entries = json.loads(table.read_text())["entries"] if table.exists() else []
    written = {e["params"]["tokens"] for e in entries}
    assert written <= {1, 16} and all(e["preset"] == "first call" for e in entries)
    # each shape's measurement is in the table, unless the machine was too busy to time it within
    # twice the bound (beside two busy loops and the suite, the 16-token one was), which it says
    for tokens in {1, 16} - written:
        assert "past twice the time bound" in why[tokens], why[tokens]
    for name in {*OWN_STRATEGIES[:2], "grouped_mm", "batched_mm"}:  # whatever it chose, any measured one is right
        dispatch._index = {key: integration.implementation(name) for key in dispatch._index}
        assert torch.equal(_generate(model, "wide_tessera"), expected), name


SECOND_PROCESS = """
import sys, warnings, torch
warnings.simplefilter("error")
from wide_tessera.dispatch import first_call
first_call.FirstCall._decide = lambda *a: sys.exit("measured again")
from wide_tessera.integrations.transformers import register
from wide_tessera.ops.hf_experts import build_experts
d = register(table=sys.argv[1], measure="first-call")
torch.manual_seed(0)
experts = build_experts("mixtral", 8, 32, 48)
experts.config._experts_implementation = "wide_tessera"
experts(torch.randn(3, 32), torch.tensor([[0, 1], [2, 3], [1, 5]]), torch.rand(3, 2))
print(list(d.chosen.values()))
"""


@pytest.mark.slow
def test_a_first_call_entry_is_reused_by_the_next_process_without_measuring(tmp_path):
    table = str(tmp_path / "dispatch.json")
    # a bound in which a busy machine's first call settles: with 0.05 s, beside two busy loops, what
    # it wrote did not decide the case, and the next process measured again; with 1 s, beside them
    # and the suite, a strategy was past twice the bound, so nothing was written (as it should be)
    dispatch = integration.register(table=table, measure="first-call", time_bound_s=5.0)
    experts = build_experts("mixtral", 8, 32, 48)
    experts.config._experts_implementation = "wide_tessera"
    experts(*_call(tokens=3))
    (name, why), = dispatch.chosen.values()
    if "past twice the time bound" in why:  # not timed, or a strategy not tried: nothing written, as it should
        pytest.skip(f"the machine was too busy to time every strategy within twice the bound: {why}")
    assert why.startswith("measured on its first call"), why
    done = subprocess.run([sys.executable, "-c", SECOND_PROCESS, table], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert name in done.stdout and "measured on its first call" not in done.stdout


def test_nothing_measured_runs_transformers_default_with_one_warning_naming_tune(tmp_path):
    dispatch = integration.register(table=str(tmp_path / "none.json"))
    experts = build_experts("qwen2_moe", 8, 32, 48)
    experts.config._experts_implementation = "wide_tessera"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [experts(*_call(tokens=t)) for t in (1, 1, 200)]
    assert len(caught) == 1 and "wide_tessera tune hf_experts" in str(caught[0].message)
    assert {name for name, _ in dispatch.chosen.values()} == {integration.DEFAULT}
    experts.config._experts_implementation = integration.DEFAULT
    torch.testing.assert_close(outs[0], experts(*_call(tokens=1)), rtol=0, atol=0)


def test_a_shape_is_looked_up_in_the_table_once(tmp_path, monkeypatch):
    dispatch = integration.register(table=str(tmp_path / "none.json"))
    looked = []
    real = integration.decide
    monkeypatch.setattr(integration, "decide", lambda *a: looked.append(1) or real(*a))
    experts = build_experts("mixtral", 8, 32, 48)
    experts.config._experts_implementation = "wide_tessera"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tokens in (1, 1, 2, 3, 4):  # buckets 1, 2, 4
            experts(*_call(tokens=tokens))
    assert len(looked) == 3 and len(dispatch.chosen) == 3


def test_without_transformers_the_op_is_an_error_by_name_and_a_skip_in_a_run_of_every_op(monkeypatch, capsys):
    from wide_tessera.cli.measure import build_jobs
    from wide_tessera.core.errors import MissingDependency
    from wide_tessera.ops import hf_experts

    monkeypatch.setattr(hf_experts, "_has_transformers", lambda: False)
    with pytest.raises(MissingDependency, match=r"pip install 'wide_tessera\[transformers\]'"):
        build_jobs(["hf_experts"], "ci", "cpu", {}, False)
    jobs = build_jobs(["gemm", "hf_experts"], "ci", "cpu", {}, False, every_op=True)
    assert [j.op for j in jobs] == ["gemm"] and "[hf_experts] SKIPPED: hf_experts needs transformers" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "verdicts,expected",
    [("fuse:8", "foreach_mm"), ("loop:8", "eager"), ("same:8", "eager"), ("disturbed:8", "grouped_mm"),
     ("unconfirmed:8", "grouped_mm")],
)  # fmt: skip
def test_a_tuned_table_decides_per_shape_and_an_inconclusive_entry_runs_the_default(verdicts, expected):
    params = dict(model_type="mixtral", tokens=4, top_k=2, hidden=32, intermediate=48, skew=0.0)
    prefill = {**params, "tokens": 256}
    table = DispatchTable(
        [entry("hf_experts", params, verdicts, strategy="foreach_mm"),
         entry("hf_experts", prefill, "fuse:8", strategy="padded")]
    )  # fmt: skip
    dispatch = integration.register(table=table)
    experts = build_experts("mixtral", 8, 32, 48)
    experts.config._experts_implementation = "wide_tessera"
    for tokens in (3, 200):
        experts(*_call(tokens=tokens))
    chosen = {key[2]: name for key, (name, _) in dispatch.chosen.items()}
    assert chosen == {4: expected, 256: "padded"}


def test_an_entry_naming_an_implementation_transformers_lacks_runs_the_loop():
    """A table written beside another transformers names an implementation this one lacks: it
    raised a KeyError that said only the name; the entry is not followed (dispatch.table.decide
    refuses a strategy the op lacks) and the experts compute what transformers' own loop does."""
    params = dict(model_type="mixtral", tokens=4, top_k=2, hidden=32, intermediate=48, skew=0.0)
    integration.register(table=DispatchTable([entry("hf_experts", params, "fuse:8", strategy="bogus_mm")]))
    experts = build_experts("mixtral", 8, 32, 48)
    call = _call(tokens=3)
    experts.config._experts_implementation = "eager"
    expected = experts(*call)
    experts.config._experts_implementation = "wide_tessera"
    torch.testing.assert_close(experts(*call), expected)


def test_a_first_call_of_experts_on_the_meta_device_is_one_line(tmp_path):
    """torch's NotImplementedError for nonzero on the meta device, from the routing."""
    integration.register(table=str(tmp_path / "none.json"), measure="first-call")
    with torch.device("meta"):
        experts = build_experts("mixtral", 8, 32, 48)
    experts.config._experts_implementation = "wide_tessera"
    with pytest.raises(WideTesseraError, match="on the meta device: load their weights first"):
        experts(*(t.to("meta") for t in _call(tokens=3)))


def test_a_run_ends_with_which_experts_implementation_to_use_for_decode_and_prefill():
    from wide_tessera import benchmark

    from .helpers import FAST

    result = benchmark(
        "hf_experts", "ci", verbose=False, device="cpu", timing=FAST, n_values=[4], tokens=[2, 64], skew=[0.0]
    )
    lines = result.summary().splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("which experts_implementation"))
    header, row = lines[title + 1].split(), lines[title + 2]
    assert header == ["model_type", "N", "decode", "prefill"] and row.startswith("mixtral")
    assert row.count("x eager") == 2 and row.count("x grouped_mm") == 2


def test_a_point_whose_n_is_below_top_k_is_skipped_with_the_reason_not_measured_under_its_label():
    """N=1 with top_k=2 routed every token to the one expert and was labelled top_k=2; a sweep
    whose every N is below top_k is refused before measuring (tests/test_bad_input.py)."""
    r = benchmark("hf_experts", preset="ci", n_values=[1, 4], verbose=False, tokens=[2], skew=[0.0], confirm="none")
    (skipped,) = [p for p in r.points if p.n == 1]
    assert skipped.failures["point"].kind == "skipped" and "top_k=2 exceeds N=1" in skipped.failures["point"].message
    assert not skipped.timings and all(p.timings for p in r.points if p.n == 4)
