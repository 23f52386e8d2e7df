"""Lowering: a stage graph → a callable for the backend (eager, Inductor), the shape buckets, CUDA graphs
over the fixed-shape stages (and which inputs a graph writes in place), tiered compilation (eager while
Inductor compiles in the background), and the log of the kernels Inductor generated. May import core only."""
