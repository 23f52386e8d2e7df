"""The draft side of SSD: the speculation server, its cache, tree, fan-out, planner and fallbacks.
May import runtime.base, core and tensor_math; it knows nothing of lanes or decoders."""
