"""What other processes leave a run on this CPU, probed before it measures and between ops: the
threads it measures with, and a busy machine named once."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..measurement.health import HealthMonitor, free_cores, load_remedy, probe_load, usable_cpus
from ..measurement.timing import TimingConfig, cpu_clock

__all__ = ["LoadWatch"]

_CPU_CLOCK = "timed by its CPU clock, which their load does not stretch"


class LoadWatch:
    """What other processes leave this CPU run, probed before it measures and between ops.

    With --threads auto the run takes the cores free when it starts; with no --threads, torch's
    choice, unless the machine is too busy for it: then it takes the free cores too, and where
    none is free, one thread, which the timer times by its CPU clock (timing.cpu_clock). Beside
    two busy loops on the 2-core machine, torch's two threads had 16 of 18 ops of the quick
    preset stopped after two DISTURBED points, every round waiting for a time slice. A
    --threads K the user gave is kept, and a machine too busy for it is named once, with what
    would measure it. The threads stay as the run began: every op's confirmation comes after
    all first passes, and a count changed between ops measured an op's passes with different
    threads (and recorded only the last)."""

    def __init__(self, threads: Union[None, int, str], timing: TimingConfig):
        self.adapt, self.asked, self.warned = threads is None or threads == "auto", threads == "auto", False
        self.timing = timing
        self.since: Optional[HealthMonitor] = None  # started at the last check: the load over the op since

    def check(self) -> Optional[str]:
        other, threads = probe_load(self.since), torch.get_num_threads()
        self.since = HealthMonitor("cpu")
        free, cores = free_cores(other), len(usable_cpus())
        seen = f"other processes use {other:.1f} of {cores} cores"
        if self.adapt:  # the first check
            self.adapt = False
            if not self.asked and threads <= free:
                return None
            self.warned = True
            torch.set_num_threads(max(1, free))
            cpu = cpu_clock("cpu", self.timing)
            clock = f", {_CPU_CLOCK}" if cpu else ""
            said = f"--threads auto: {seen}" if self.asked else f"busy machine: {seen}, too busy for torch's {threads}"
            return f"{said}: measuring with {max(1, free)} thread(s){clock}"
        if threads <= free or self.warned:
            return None
        self.warned = True
        if cpu_clock("cpu", self.timing):
            return f"busy machine: {seen}: this run's one thread is {_CPU_CLOCK}"
        return (
            f"busy machine: {seen}, and this run's {threads} threads need {threads} free: its points will wait "
            f"for time slices and read DISTURBED; {load_remedy(other)}"
        )
