"""A result in a notebook cell: Jupyter shows `_repr_html_` (the verdict, the answer table, the
speedup plots inline where matplotlib is installed) or `_repr_markdown_` (reports.markdown)."""

from __future__ import annotations

import base64
import html
import io
from typing import TYPE_CHECKING, List

from ..core.errors import WideTesseraError
from .brief import brief_summary
from .plots import group_figures

if TYPE_CHECKING:
    from ..results.schema import BenchmarkResult

__all__ = ["result_html"]


def _images(result: "BenchmarkResult") -> List[str]:
    """Each group's figure as an inline PNG; none without matplotlib."""
    try:
        figures = group_figures(result)
    except WideTesseraError:  # no matplotlib: the table alone
        return []
    images = []
    for figure in figures:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=80)
        encoded = base64.b64encode(buffer.getvalue()).decode()
        images.append(f'<img src="data:image/png;base64,{encoded}" style="max-width:100%"/>')
    return images


def result_html(result: "BenchmarkResult") -> str:
    """The brief summary (the verdict first, one row per point, the crossover) as preformatted
    text, then the plots."""
    lines = brief_summary(result).splitlines()
    head, rest = lines[0], "\n".join(lines[1:])
    return (
        f"<div><p><b>{html.escape(head)}</b></p>"
        f"<pre style='font-size:12px'>{html.escape(rest)}</pre>" + "".join(_images(result)) + "</div>"
    )
