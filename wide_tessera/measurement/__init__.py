"""How one callable is measured: settings and presets, the timer, stage limits, machine health, memory, launches,
energy, the roofline, the modes (what one timed call does) and the controls. Knows no op and no results file."""
