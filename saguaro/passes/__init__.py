"""Passes: ``GraphModule -> GraphModule`` rewrites, one per file, run in order by ``pipeline``."""

from saguaro.passes.pipeline import PIPELINE, run_pipeline

__all__ = ["PIPELINE", "run_pipeline"]
