"""Errors raised by Saguaro. Bad user input raises ``ValueError`` or a ``SaguaroError`` subclass."""


class SaguaroError(Exception):
    """Base class of every error Saguaro raises on purpose."""


class CaptureError(SaguaroError):
    """A model could not be captured into an FX graph; the message names the model class or node."""


class ConfigError(SaguaroError, ValueError):
    """A configuration value is outside what is allowed; the message names the value."""


class ArtifactError(SaguaroError):
    """An exported program cannot be written or loaded here; the message names the file and what to do."""
