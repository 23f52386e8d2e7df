"""The draft side of SSD: the speculation server (glue, fork, tree decode), its speculation cache,
the fork plan and fan-out, the planner and the neural / fast fallbacks.
May import runtime.base, core and tensor_math; it knows nothing of lanes or decoders."""
