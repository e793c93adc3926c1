"""Reading results: the text summary, tidy rows, Markdown, the report page, plots and the comparison of two runs.
Never measures.

Importing the package gives results their views (`result.summary()`, `.warnings`, `.to_rows()`,
`.to_dataframe()`; see results.views).
"""

from ..results.views import register_view
from . import brief, markdown, notebook, text, tidy

register_view("summary", text.format_summary)
register_view("brief", brief.brief_summary)
register_view("html", notebook.result_html)
register_view("markdown", markdown.result_markdown)
register_view("warnings", text.warning_lines)
register_view("rows", tidy.rows)
register_view("dataframe", tidy.to_dataframe)
