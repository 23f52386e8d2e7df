"""Lowering: a stage graph → a callable for the backend (eager, Inductor), the shape buckets, and the
log of the kernels Inductor generated. May import core only."""
