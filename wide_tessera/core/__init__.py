"""Leaf services every layer uses: errors and checks of user input, what a job is (sweep and factories), what a
strategy needs, trees of tensors, statistics, output correctness, the environment, files and JSON. Imports nothing
else of wide_tessera."""
