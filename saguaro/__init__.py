"""Saguaro: speculative speculative decoding as a compiler over Hugging Face causal LMs.
Lives here: the public API (compile, load, default_pair, inspect, sampling controls, errors) and the modules
that wire it (compile, load, default_pair, models_io). These may import every library folder but inspection,
bench and serve (this __init__ imports inspect); nothing but the CLI imports the CLI."""

# ``saguaro.compile``, ``saguaro.load`` and ``saguaro.default_pair`` name functions, not their submodules,
# like ``torch.compile``: importing a function rebinds the package attribute, and ``default_pair`` is
# defined below, after its submodule was imported (a later import of the submodule rebinds nothing).
from saguaro import default_pair as _default_pair_module
from saguaro.compile import compile
from saguaro.core.errors import ArtifactError, CaptureError, ConfigError, SaguaroError
from saguaro.inspection.inspector import inspect
from saguaro.load import load
from saguaro.tensor_math.grammar import Grammar, GrammarError
from saguaro.tensor_math.logits_processing import ControlError, SamplingControls

__version__ = "0.1.0"

__all__ = [
    "compile",
    "load",
    "default_pair",
    "inspect",
    "SamplingControls",
    "ControlError",
    "Grammar",
    "GrammarError",
    "ArtifactError",
    "SaguaroError",
    "CaptureError",
    "ConfigError",
    "__version__",
]


def default_pair(dtype=None):
    """Return ``(target, draft, tokenizer)``: the pair trained by the project and shipped with it."""
    return _default_pair_module.load_default_pair(dtype=dtype)
