"""Lowering: which kernels a stage takes, a stage graph → a callable for the backend (eager, Inductor), the
shape buckets, CUDA graphs over the fixed-shape stages (and which inputs a graph writes in place), tiered
compilation (eager while Inductor compiles behind), the log of Inductor's kernels. May import core only."""
