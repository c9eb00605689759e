"""The data module's one exception type: its message is the one line a user sees."""


class DataError(RuntimeError):
    """A dataset problem a user can fix: missing repo, revision, path, remote or credentials."""
