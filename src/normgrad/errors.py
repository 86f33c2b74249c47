"""The errors the training layer raises for a user's mistake: each names the input and the
rule it breaks in one line (the CLI prints it as such, without a traceback).

This module is at the bottom of the package's layers: it imports nothing of normgrad, so any
module can raise these. Each is also importable where it is used (``normgrad.TrainerError``,
``normgrad.train.TrainerError``, ``normgrad.checkpoint.CheckpointError``,
``normgrad.lora.LoraError``)."""

from __future__ import annotations

__all__ = ["TrainerError", "CheckpointError", "LoraError"]


class TrainerError(ValueError):
    """A step graph, checkpoint, batch or option the trainer cannot use."""


class CheckpointError(ValueError):
    """A file that is not a readable checkpoint, or one that does not match what is expected."""


class LoraError(ValueError):
    """A model without LoRA adapters, an adapter peft's format cannot hold, or a missing tensor."""
