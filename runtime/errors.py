"""Runtime errors a user can hit. Each message is one sentence that names the fix."""

from tinyinfer.formats import TinyInferError


class LoadError(TinyInferError):
    """A model file cannot be found or loaded."""


class DeviceError(TinyInferError):
    """The requested device (CUDA GPU) is not usable."""


class ContextOverflowError(TinyInferError):
    """The prompt plus the requested new tokens do not fit in the model's context. The counts, when
    known, let a caller name its own fix (a CLI flag, a chat command)."""

    def __init__(self, message: str, prompt_tokens: int | None = None, new_tokens: int | None = None,
                 context: int | None = None):
        super().__init__(message)
        self.prompt_tokens, self.new_tokens, self.context = prompt_tokens, new_tokens, context


class ChatTemplateError(TinyInferError):
    """The model has no chat template, or its template rejected the conversation."""


class SamplingError(TinyInferError):
    """A sampling parameter is out of range."""


class SlotsFullError(TinyInferError):
    """Every sequence slot of a batched engine is busy."""


class TokenIdError(TinyInferError, ValueError):
    """A token id outside the model's vocabulary would reach a backend (a ValueError too, as callers
    passing their own ids expect)."""


class NonFiniteLogitsError(TinyInferError):
    """The model computed NaN or infinite logits, which no sampler can draw from (corrupt weights)."""
