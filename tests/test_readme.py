"""The Python examples of the README and of docs/ run as written."""

import re
from pathlib import Path

import pytest

from wide_tessera.measurement import settings

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [
    (page.relative_to(ROOT).as_posix(), i, code)
    for page in PAGES
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
]


def test_the_readme_and_the_docs_have_examples():
    assert sum(page == "README.md" for page, _, _ in EXAMPLES) >= 2 and len(EXAMPLES) >= 5


@pytest.mark.parametrize("page,i,code", EXAMPLES, ids=[f"{page}:{i}" for page, i, _ in EXAMPLES])
def test_an_example_runs(page, i, code, monkeypatch, fast_timing, capsys, tmp_path):
    monkeypatch.setattr(settings, "default_timing", lambda preset=None: fast_timing)
    monkeypatch.chdir(tmp_path)  # the files an example writes
    exec(compile(code, page, "exec"), {"__name__": "readme_example"})  # what it registers leaves with the test
    out = capsys.readouterr().out
    if ".summary()" in code:  # an example that prints a summary prints its answer
        assert "crossover_n:" in out and "recommended_threshold:" in out


def test_every_page_the_readme_names_exists():
    named = re.findall(r"\]\((docs/[\w.-]+\.md)\)", (ROOT / "README.md").read_text())
    assert named and all((ROOT / page).exists() for page in named)
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= set(named)  # no page left unlisted
