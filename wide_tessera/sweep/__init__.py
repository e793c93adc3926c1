"""The point loop: measure a job's points (in this process or an isolated worker), confirm the deciding ones, resume,
shard under torchrun, show progress."""
