"""Saguaro: speculative speculative decoding as a compiler over Hugging Face causal LMs."""

from saguaro.errors import CaptureError, ConfigError, SaguaroError

# ``saguaro/compile.py`` is the entry module; importing its function here rebinds the package
# attribute ``saguaro.compile`` from the submodule to the function, like ``torch.compile``.
from saguaro.compile import compile  # noqa: E402,A001

__version__ = "0.1.0"

__all__ = ["compile", "default_pair", "SaguaroError", "CaptureError", "ConfigError", "__version__"]


def default_pair(dtype=None):
    """Return ``(target, draft, tokenizer)``: the pair trained by the project and shipped with it."""
    from saguaro.default_pair import load_default_pair

    return load_default_pair(dtype=dtype)
