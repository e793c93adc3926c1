"""Reading results: the text summary, tidy rows, Markdown, the report page, plots and the comparison of two runs. Never measures."""
