"""The errors the training layer raises for a user's mistake: each names the input and the
rule it breaks in one line (the CLI prints it as such, without a traceback; :func:`one_line`
puts any message on one line).

This module is at the bottom of the package's layers: it imports nothing of normgrad, so any
module can raise these. Each is also importable where it is used (``normgrad.TrainerError``,
``normgrad.train.TrainerError``, ``normgrad.checkpoint.CheckpointError``,
``normgrad.lora.LoraError``)."""

from __future__ import annotations

__all__ = ["TrainerError", "CheckpointError", "LoraError", "one_line"]


class TrainerError(ValueError):
    """A step graph, checkpoint, batch or option the trainer cannot use."""


class CheckpointError(ValueError):
    """A file that is not a readable checkpoint, or one that does not match what is expected."""


class LoraError(ValueError):
    """A model without LoRA adapters, an adapter peft's format cannot hold, or a missing tensor."""


def one_line(error: BaseException) -> str:
    """An exception's message on one line (an OSError's as ``FILE: what``, not ``[Errno N] ...``)."""
    text = str(error)
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.filename}: {error.strerror}" if error.filename is not None else error.strerror
    return " ".join(text.split()) or type(error).__name__
