"""Saguaro: speculative speculative decoding as a compiler over Hugging Face causal LMs."""

from saguaro.core.errors import ArtifactError, CaptureError, ConfigError, SaguaroError

# ``saguaro/compile.py`` is the entry module; importing its function here rebinds the package
# attribute ``saguaro.compile`` from the submodule to the function, like ``torch.compile``.
from saguaro.compile import compile  # noqa: E402,A001
# likewise ``saguaro.load`` names the function of ``saguaro/load.py``
from saguaro.load import load  # noqa: E402

# Likewise the submodule ``saguaro.default_pair`` is imported first, so that the function below, not
# the module, is what ``saguaro.default_pair`` names (a later import of the submodule rebinds nothing).
from saguaro import default_pair as _default_pair_module  # noqa: E402

from saguaro.inspection.inspector import inspect  # noqa: E402
from saguaro.tensor_math.logits_processing import ControlError, SamplingControls  # noqa: E402

__version__ = "0.1.0"

__all__ = ["compile", "load", "default_pair", "inspect", "SamplingControls", "ControlError", "ArtifactError", "SaguaroError", "CaptureError",
           "ConfigError", "__version__"]


def default_pair(dtype=None):
    """Return ``(target, draft, tokenizer)``: the pair trained by the project and shipped with it."""
    return _default_pair_module.load_default_pair(dtype=dtype)
