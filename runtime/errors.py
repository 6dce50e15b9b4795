"""Runtime errors a user can hit. Each message is one sentence that names the fix."""

from tinyinfer.formats import TinyInferError


class LoadError(TinyInferError):
    """A model file cannot be found or loaded."""


class DeviceError(TinyInferError):
    """The requested device (CUDA GPU) is not usable."""


class ContextOverflowError(TinyInferError):
    """The prompt plus the requested new tokens do not fit in the model's context."""


class ChatTemplateError(TinyInferError):
    """The model has no chat template, or its template rejected the conversation."""


class SamplingError(TinyInferError):
    """A sampling parameter is out of range."""
