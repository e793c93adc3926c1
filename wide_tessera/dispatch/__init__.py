"""The dispatch table of measured verdicts, and fuse(): the wide module where the measurements say fusing wins."""
