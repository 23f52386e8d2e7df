"""Calls of one compiled stage that differ only in their first few arguments: the draft's chained steps, each
fed the query the call before returned, over the same store.

A stage call keys its arguments' shapes (twice for a stage compiled in the background: the tiered stage's key
and the compiled stage's), finds the direct call for that key and rebuilds all its inputs (the store's caches,
the weights it holds, the sizes), about 30 us a call on a CPU beside a small draft's 160 us step. A
:class:`RepeatedCall` does that once, for the arguments of a call that ran already: each later call puts in
only the arguments that change, after checking they have the shapes and strides of the first (a mismatch
returns None, and the caller makes the stage's own call). It exists only where that first call went to
Inductor's graph function directly (:mod:`~saguaro.lower.direct_call`): not while a tiered stage still runs
eager for these shapes, not through dynamo, not under CUDA graphs."""

from __future__ import annotations

import torch


class RepeatedCall:
    """``call(*changed)``: the stage on ``args`` with its first ``len(changed)`` arguments replaced; None when one
    of them differs in shape or strides from the one it replaces. ``counted``: a callable run on each call (the
    stages' call counts)."""

    def __init__(self, direct, args, varying: int, counted):
        self.boxed, self.counted = direct.boxed, counted
        self.applies = direct.applies  # whether this thread's global state is still the recorded call's
        self.inputs = direct.boxed_inputs(args)
        self.replaced = [(j, i) for j, i in direct._arguments if i < varying]  # (input position, argument position)
        self.layouts = [(a.shape, a.stride()) for a in args[:varying]]

    def __call__(self, *changed):
        for a, (shape, stride) in zip(changed, self.layouts):
            if a.shape != shape or a.stride() != stride:
                return None
        inputs = self.inputs.copy()  # the graph function frees the list it is given
        for j, i in self.replaced:
            inputs[j] = changed[i]
        self.counted()
        return tuple(self.boxed(inputs))


def repeated_call(stage, args, varying: int) -> RepeatedCall | None:
    """A :class:`RepeatedCall` of ``stage`` (a ``CompiledStage``, or a ``TieredStage`` whose compiled form serves
    these shapes) for calls like ``stage(*args)``, its first ``varying`` arguments changing; None where the call
    does not go to Inductor's graph function directly."""
    tiered = stage if hasattr(stage, "compiled_calls") else None
    if tiered is not None:
        if tiered._positions.key(args) not in tiered._ready:
            return None
        stage = tiered.compiled
    direct_calls = getattr(stage, "_direct", None)
    if not direct_calls or torch.autograd.profiler._is_profiler_enabled:
        return None
    direct = direct_calls.get(stage._positions.key(args))
    if direct is None or direct.boxed is None or not direct.applies():
        return None

    def counted() -> None:
        stage.calls += 1
        if tiered is not None:
            tiered.compiled_calls += 1

    return RepeatedCall(direct, args, varying, counted)
