"""Exceptions raised by model loading and request validation.

ValueError
  └── RequestError          a request this model cannot serve (unknown voice, text too long)
CheckpointError             a checkpoint that cannot be loaded (missing file or tensor, bad shape)
"""

__all__ = ["CheckpointError", "RequestError"]


class RequestError(ValueError):
    """The request is invalid for this model; the message names the field and the rule."""


class CheckpointError(RuntimeError):
    """The checkpoint cannot be loaded; the message names the file or tensor."""
