"""The one base class of the errors a user can act on.

det-lab's root command (``det_lab/cli/app.py``) prints a ``UserError`` as one ``error:`` line and
exits 2; any other exception is a bug and keeps its traceback. A package's error class subclasses
it and keeps the builtin base it had (``class SlurmConfigError(UserError, ValueError)``), so code
that catches the builtin still does; tests/test_user_errors.py names any error class that is
neither a UserError nor listed there as internal. A leaf module: it imports nothing of det_lab.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, config or machine, said in one line that names the fix."""
