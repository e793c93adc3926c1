"""The collectives under torchrun: cases, their statistics and files, and the rank-parallel run."""
