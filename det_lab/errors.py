"""The one base class of the errors a user can act on.

The CLI's entry point prints a ``UserError`` as one ``error:`` line and exits 2; any other
exception is a bug and keeps its traceback. A leaf module: it imports nothing of det_lab.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, config or machine, said in one line that names the fix."""
