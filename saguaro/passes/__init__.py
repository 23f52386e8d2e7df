"""Passes: ``GraphModule -> GraphModule`` rewrites, one per file, each declaring the facts it requires
and guarantees (``graph_pass``); ``pipeline`` runs them in order, checking those contracts.
May import core, capture (the attention op) and tensor_math (the epilogues spliced into stages)."""

from saguaro.passes.pipeline import PIPELINE, run_pipeline

__all__ = ["PIPELINE", "run_pipeline"]
