"""The model store's errors: each one line naming the fix (printed once by det-lab's entry point)."""

from __future__ import annotations

from det_lab.errors import UserError


class ModelStoreError(UserError, ValueError):
    """Bad input to the store: a directory that is not a snapshot, a name that is not ``org/name``,
    a model the volume does not hold."""


class ModelMissing(UserError, FileNotFoundError):
    """A base model, tokenizer or backbone file a run needs is not on the volume; the message names
    the ``det-lab models import`` that puts it there."""
