"""The data module's one exception type: its message is the one line a user sees."""

from det_lab.errors import UserError


class DataError(UserError, RuntimeError):
    """A dataset problem a user can fix: missing repo, revision, path, remote or credentials."""
