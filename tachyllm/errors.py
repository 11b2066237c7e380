"""Typed exceptions: callers can tell bad input from engine failures without parsing messages."""


class TachyError(Exception):
    """Base class of every error tachyllm raises on purpose."""


class ConfigError(TachyError, ValueError):
    """An engine or model option is invalid or unsupported."""


class ModelLoadError(TachyError):
    """A model path is missing, unreadable, corrupt, or of an unsupported architecture."""


class RequestError(TachyError, ValueError):
    """A single request cannot be served (empty prompt, too long, ...); other requests are unaffected.

    `param` names the request field at fault (e.g. "stop_token_ids"), when one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineCorruptedError(TachyError):
    """The engine's state is no longer consistent (after a failed step): it must be restarted."""


class WorkerError(EngineCorruptedError):
    """A tensor-parallel worker failed or died, or the group failed a step: the engine cannot go on."""


class AdapterError(RequestError):
    """A LoRA adapter cannot be served (missing files, an unsupported variant, shapes that do not match
    the base model): the request that names it fails, or the server refuses to start with it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="lora_request")
