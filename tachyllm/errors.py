"""Typed exceptions: callers can tell bad input from engine failures without parsing messages."""


class TachyError(Exception):
    """Base class of every error tachyllm raises on purpose."""


class ConfigError(TachyError, ValueError):
    """An engine or model option is invalid or unsupported."""


class ModelLoadError(TachyError):
    """A model path is missing, unreadable, corrupt, or of an unsupported architecture."""


class RequestError(TachyError, ValueError):
    """A single request cannot be served (empty prompt, too long, ...); other requests are unaffected."""
