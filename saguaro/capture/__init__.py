"""Capture: Hugging Face causal LM → FX graph with one saguaro attention node per layer.
May import core only."""

from saguaro.capture.export import CapturedModel, ModelSpec, capture, model_spec

__all__ = ["CapturedModel", "ModelSpec", "capture", "model_spec"]
