"""A result in a notebook cell: Jupyter shows `_repr_html_` (the verdict, the answer as an HTML
table, as pandas gives, the speedup plots inline where matplotlib is installed) or
`_repr_markdown_` (reports.markdown)."""

from __future__ import annotations

import base64
import html
import io
from typing import TYPE_CHECKING, List

from ..core.errors import WideTesseraError
from .brief import answer_table, headline
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


def _row(cells: List[str], tag: str) -> str:
    return "<tr>" + "".join(f"<{tag}>{html.escape(cell)}</{tag}>" for cell in cells) + "</tr>"


def result_html(result: "BenchmarkResult") -> str:
    """The headline, then a table with one row per point (N, every parameter, the baseline's
    time, each strategy's speedup with its interval, the decision), then the plots."""
    header, rows = answer_table(result, list(result.points[0].params) if result.points else [])
    return (
        f"<div><p><b>{html.escape(headline(result))}</b></p>"
        f"<table><thead>{_row(header, 'th')}</thead>"
        f"<tbody>{''.join(_row(row, 'td') for row in rows)}</tbody></table>" + "".join(_images(result)) + "</div>"
    )
