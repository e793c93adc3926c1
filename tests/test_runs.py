"""Runs are kept: every measuring command saves its result in the runs folder, `runs` lists
them, and show, plot, report and compare take the latest without a path."""

import dataclasses
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

import wide_tessera as wt
from wide_tessera.cli import cli
from wide_tessera.core.runs import saved_runs

ROOT = Path(__file__).resolve().parent.parent
GEMM = ["benchmark", "gemm", "--preset", "ci", "--device", "cpu", "--n-values", "1,2", "--budget", "0.005", "--quiet"]


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.mark.slow
def test_a_run_without_o_is_kept_listed_shown_plotted_and_reported(tmp_path):
    r = invoke(*GEMM)
    assert r.exit_code == 0, r.output
    (kept,) = saved_runs()
    assert kept.name.endswith(".json") and "_benchmark_gemm_ci_" in kept.name and str(kept) in r.stderr
    assert (kept.parent / ".gitignore").read_text().strip().endswith("*")  # this machine's, not the project's
    (result,) = wt.load_results(kept)
    listed = invoke("runs")
    assert listed.exit_code == 0 and "@-1" in listed.output and "gemm" in listed.output and "ci" in listed.output
    shown = invoke("show")
    assert shown.exit_code == 0 and "== gemm (preset ci)" in shown.output
    run_id = kept.stem.split("_")[-1]
    assert invoke("show", run_id).output == shown.output == invoke("show", "@-1").output
    # the result's own run id, which a markdown report names: it found nothing
    assert f"run `{result.run_id}`" in invoke("show", "--format", "markdown").output
    assert invoke("show", result.run_id).output == shown.output
    plots = invoke("plot", "-o", str(tmp_path / "plots"))
    assert plots.exit_code == 0 and list((tmp_path / "plots").glob("*.png"))
    page = invoke("report", "-o", str(tmp_path / "report"))
    assert page.exit_code == 0 and (tmp_path / "report" / "README.md").exists()


def test_compare_takes_the_latest_two_and_one_file_against_the_latest(tmp_path):
    assert invoke(*GEMM).exit_code == 0
    assert invoke(*GEMM).exit_code == 0
    first, second = saved_runs()
    both = invoke("compare")
    assert both.exit_code == 0 and "COMPARE:" in both.output
    assert invoke("compare", str(first)).output == both.output
    assert invoke("compare", "@-2", "@-1").output == both.output


def test_a_run_says_how_its_crossovers_fare_in_the_previous_run_measured_alike(tmp_path):
    # one thread given: with torch's choice, a machine busy at one run and not the other (the suite's
    # own workers) measures them with different threads, rightly not alike
    alike = [*GEMM, "--threads", "1"]
    first = invoke(*alike)
    assert first.exit_code == 0 and "AGAINST THE PREVIOUS RUN" not in first.output  # nothing before it
    earlier = Path(first.output.split("wrote 1 result(s) to ")[1].split()[0]).name  # the first run's file
    second = invoke(*alike)
    assert f"AGAINST THE PREVIOUS RUN ({earlier}, measured alike): " in second.output
    # measured otherwise (another seed): not a repeat, so no verdict on the runs' agreement
    assert "AGAINST THE PREVIOUS RUN" not in invoke(*alike, "--seed", "7").output


@pytest.mark.slow
def test_no_save_keeps_nothing_and_o_still_writes_where_asked(tmp_path):
    assert invoke(*GEMM, "--no-save").exit_code == 0 and saved_runs() == []
    out = tmp_path / "r.json"
    assert invoke(*GEMM, "-o", str(out)).exit_code == 0
    assert out.exists() and len(saved_runs()) == 1  # -o writes there, and the run is kept too
    refused = invoke(*GEMM, "-o", str(out))  # an existing results file is not silently replaced
    assert (
        refused.exit_code == 2
        and "holds results already; --resume continues it, --overwrite replaces it" in refused.output
    )
    assert invoke(*GEMM, "-o", str(out), "--overwrite").exit_code == 0


def test_an_unwritable_runs_folder_is_one_line_and_the_answer_is_still_printed(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("WIDE_TESSERA_RUNS", str(blocker / "runs"))
    r = invoke(*GEMM)
    assert r.exit_code == 0 and "== gemm" in r.stdout
    lines = [line for line in r.stderr.splitlines() if "runs folder" in line]
    assert len(lines) == 1 and "this run is not kept" in lines[0] and "Traceback" not in r.output


def test_a_damaged_file_hides_no_other_run(tmp_path):
    assert invoke(*GEMM).exit_code == 0
    folder = saved_runs()[0].parent
    (folder / "20990101T000000Z_benchmark_x_ci_bad123.json").write_text("{not json")
    listed = invoke("runs")
    assert listed.exit_code == 0 and "DAMAGED" in listed.output and "gemm" in listed.output
    assert invoke("show", "@-2").exit_code == 0
    assert invoke("show", "@-9").exit_code == 2


@pytest.mark.slow
def test_concurrent_runs_are_both_kept(tmp_path):
    env = dict(os.environ, WIDE_TESSERA_RUNS=str(tmp_path / "runs"))
    command = [sys.executable, "-m", "wide_tessera", *GEMM]
    procs = [
        subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    kept = sorted((tmp_path / "runs").glob("*.json"))
    assert len(kept) == 2 and all(len(wt.load_results(p)) == 1 for p in kept)


class _Rows(HTMLParser):
    """The cells of each <tr> in a page, as text."""

    def __init__(self):
        super().__init__()
        self.rows, self.cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.cell = ""

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append(self.cell)
            self.cell = None


def test_a_result_shows_itself_in_a_notebook():
    (result,) = wt.load_results(Path(__file__).parent / "golden" / "schema6.json")[:1]
    page = result._repr_html_()
    assert page.startswith("<div>") and "== gemm (preset ci)" in page and "<pre" not in page
    parser = _Rows()
    parser.feed(page)
    header, *rows = parser.rows
    assert header == ["N", "batch", "in_features", "out_features", "dtype", "baseline ms", "bmm", "einsum", "decision"]
    assert [row[0] for row in rows] == [str(p.n) for p in result.points]  # one row per point
    assert rows[1][6:] == ["1.14x [1.11,1.48]", "0.68x [0.58,0.87]", "bmm"]
    assert "<b>== &lt;op&gt; (preset ci)" in dataclasses.replace(result, op="<op>")._repr_html_()  # escaped
    pytest.importorskip("matplotlib")
    assert page.count("data:image/png;base64,") == len(result.groups)
    assert result._repr_markdown_().startswith("### gemm (preset ci)")


def test_traces_hold_each_callables_operators_and_n_calls_show_n_times_one_fused_call(tmp_path):
    import json

    traces = tmp_path / "traces"
    r = invoke(*GEMM, "--n-values", "1,8", "--trace", str(traces), "--trace-n", "8")
    assert r.exit_code == 0, r.output
    written = sorted(traces.glob("*.json"))
    assert [p.name.split("_")[-1] for p in written] == ["baseline.json", "bmm.json", "einsum.json"]
    assert all("_N8_" in p.name and "batch=16" in p.name for p in written) and str(written[0]) in r.stderr

    def aten(path):
        events = json.loads(path.read_text())["traceEvents"]
        return [e["name"] for e in events if e.get("name") in ("aten::linear", "aten::baddbmm")]

    baseline, bmm = aten(written[0]), aten(written[1])
    assert baseline.count("aten::linear") == 8 * 3  # N separate calls, three traced calls
    assert bmm.count("aten::baddbmm") == 3 and "aten::linear" not in bmm  # one batched product per call
