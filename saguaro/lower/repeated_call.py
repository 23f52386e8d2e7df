"""Repeated calls: calls of one compiled stage that differ only in their first arguments (chained steps).

A :class:`RepeatedCall` rebuilds a call's inputs once and puts in only the changed arguments each call,
skipping the shape key and the direct call's rebuild (docs/measurements/2026-12-06-draft-chain.md). It
exists only where that call went to Inductor's graph function directly (:mod:`~saguaro.lower.direct_call`).
"""

from __future__ import annotations

import torch


class RepeatedCall:
    """``call(*changed)``: the stage on ``args``, its first ``len(changed)`` replaced; None when one differs
    in shape or strides. ``counted``: called on each call (the stages' call counts)."""

    def __init__(self, direct, args, varying: int, counted):
        self.boxed, self.counted = direct.boxed, counted
        self.applies = direct.applies  # whether this thread's global state is still the recorded call's
        self.inputs = direct.boxed_inputs(args)
        self.replaced = [
            (j, i) for j, i in direct._arguments if i < varying
        ]  # (input position, argument position)
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
    """A :class:`RepeatedCall` of ``stage`` (a ``CompiledStage``, or a ``TieredStage`` compiled for these
    shapes) for calls like ``stage(*args)``; None where the call does not go to Inductor's graph directly."""
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
