"""The README's Python examples run as written."""

import re
from pathlib import Path

import pytest

from wide_tessera.measurement import settings

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_examples():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code, monkeypatch, fast_timing, capsys, tmp_path):
    monkeypatch.setattr(settings, "default_timing", lambda preset=None: fast_timing)
    monkeypatch.chdir(tmp_path)  # the files an example writes
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})  # what it registers leaves with the test
    out = capsys.readouterr().out
    assert "crossover_n:" in out and "recommended_threshold:" in out
