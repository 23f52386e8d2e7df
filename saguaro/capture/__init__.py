"""Capture: a Hugging Face causal LM as an FX graph, one attention op a layer. May import core only."""

from saguaro.capture.export import CapturedModel, ModelSpec, capture, model_spec

__all__ = ["CapturedModel", "ModelSpec", "capture", "model_spec"]
