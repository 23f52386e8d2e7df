"""Seeing what the compiler built: the inspector (passes, graphs, schedule, kernels), its text/SVG
views and the HTML report. May import core, passes, lower, runtime (its base: trace reading) and
the top-level compile / default_pair (to inspect models not yet compiled)."""
