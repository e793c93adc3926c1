"""Reading results: the text summary, tidy rows, Markdown, the report page, plots and the comparison of two runs.
Never measures.

A result's `summary()`, `.warnings`, `.to_rows()` and the like are thin calls into these modules
(results.schema.BenchmarkResult).
"""
