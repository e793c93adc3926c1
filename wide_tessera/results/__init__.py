"""What a run found, as data (schema), and what is computed from it (analysis): speedups, decisions, crossovers,
reliability; the run manifest; saving and loading with every invariant checked. Never imports what renders it."""
