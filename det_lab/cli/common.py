"""What every det-lab command shares: the console, loading settings, and one-line errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from rich.console import Console

if TYPE_CHECKING:
    from det_lab.settings import LabSettings

# Piped or redirected output keeps whole lines: paths and commands are for copying, and rich
# would otherwise cut tables to 80 columns with an ellipsis.
_UNLIMITED = 10_000
console = Console(width=None if sys.stdout.isatty() else _UNLIMITED)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else _UNLIMITED)


class State:
    """Per-invocation state handed from the app callback to the commands."""

    def __init__(self, config: Path | None) -> None:
        self.config = config
        self._settings: LabSettings | None = None

    @property
    def settings(self) -> LabSettings:
        if self._settings is None:
            from det_lab.settings import load_settings

            self._settings = load_settings(self.config)  # a LabConfigError is the entry point's one error line
        return self._settings


def state(ctx: typer.Context) -> State:
    return ctx.ensure_object(State) if ctx.obj is None else ctx.obj


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one line to stderr and exit: the only way det-lab reports a user error. ``message``
    is plain text: brackets in it (``members[alice]``, a tool's ``[error]``) are printed as they are."""
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def report_user_error(exc: BaseException, code: int = 2) -> NoReturn:
    """Print a :class:`~det_lab.errors.UserError` as the one ``error:`` line and exit with ``code``
    (for the entry point, outside typer's own handling of ``typer.Exit``)."""
    from rich.markup import escape

    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    raise SystemExit(code)


def print_json(data: Any) -> None:
    """Print ``data`` as one indented JSON document on stdout: what every ``--json`` prints (paths
    and other non-JSON values as their text)."""
    typer.echo(json.dumps(data, indent=2, default=str))


def print_dry_run(lines: Iterable[str], footer: str) -> None:
    """A dry run's plan, a line each, then ``footer`` saying that nothing changed."""
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
    console.print(footer, highlight=False)


def out_dir(out: Path, writes: str | None = None) -> Path:
    """``out``, checked as the ``--out`` directory a command writes its named files into: an
    existing regular file is one error line, and so is a new path named like the file ``writes``
    (``--out nb.yaml`` from a script written when that ``--out`` named the file)."""
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file: --out names a directory, the command writes its files inside")
    if writes and not out.exists() and out.suffix and out.suffix == Path(writes).suffix:
        fail(f"--out {out} looks like a file name: --out names a directory, the command writes {writes} "
             f"inside (e.g. --out {out.parent})")
    return out


T = TypeVar("T")


def renamed_option(new_value: T, old_value: T | None, old: str, new: str) -> T:
    """The value of option ``new``, or of its hidden old spelling ``old`` when that was given (said
    on stderr as deprecated: scripts that use it keep working for one release)."""
    if old_value is None:
        return new_value
    from det_lab.public import DEPRECATED

    removal = next((d.removal for spelling, d in DEPRECATED.items()
                    if spelling.endswith(f" {old}") and d.new.endswith(f" {new}")), "a later release")
    err_console.print(f"[yellow]deprecated:[/] {old} is now {new}; the old spelling goes in det_lab {removal}",
                      highlight=False, soft_wrap=True)
    return old_value


def viewer_command(backend: str, target: str) -> str:
    """How to look at a run's metrics in ``backend``'s UI, given where they were delivered."""
    if backend == "mlflow":
        if target.startswith(("http://", "https://")):
            return f"open {target} in a browser"
        return f"mlflow ui --backend-store-uri {target}"
    if backend == "aim":
        if target.startswith("aim://"):
            return f"aim up --repo <the repo that 'aim server' at {target} serves> (on that machine)"
        return f"aim up --repo {target}"
    return target
