"""Passes: ``GraphModule -> GraphModule`` rewrites, one per file, run in order by ``pipeline``.
May import core, capture (the attention op) and tensor_math (the epilogues spliced into stages)."""

from saguaro.passes.pipeline import PIPELINE, run_pipeline

__all__ = ["PIPELINE", "run_pipeline"]
