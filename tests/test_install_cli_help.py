"""Every det-lab command's --help, as a user reads it: no type placeholders on flags, every option
described, no reStructuredText markup, templates named as `det-lab templates list` names them."""

from __future__ import annotations

from typing import Any

import pytest
import typer.main
from typer.core import TyperOption
from typer.testing import CliRunner

from det_lab import templates
from det_lab.cli.app import app

ROOT = typer.main.get_command(app)
#: names a template must not be given in help (its directory names, not what users type)
DIRECTORY_NAMES = [d for n, d in templates.NAMES.items() if d != n]


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = [(path, cmd)]
    for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
        out += _commands(sub, (*path, name))
    return out


COMMANDS = _commands(ROOT)


def test_every_command_is_walked():
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"run", "templates list", "templates copy", "cluster config", "data pull", "doctor"} <= names


@pytest.mark.parametrize("path, cmd", COMMANDS, ids=[" ".join(p) or "det-lab" for p, _ in COMMANDS])
def test_help_is_plain_complete_and_consistent(path, cmd):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = result.output
    assert "<bool>" not in text, text  # a flag takes no value
    assert "`" not in text and ":func:" not in text, text  # reStructuredText/Markdown, shown raw
    for d in DIRECTORY_NAMES:
        assert d not in text, f"{' '.join(path)}: says {d!r}, not its template name\n{text}"
    undescribed = [p.opts[0] for p in cmd.params
                   if isinstance(p, TyperOption) and not p.hidden and not (p.help or "").strip()]
    assert undescribed == [], f"det-lab {' '.join(path)}: options without a description: {undescribed}"
    assert (cmd.help or cmd.short_help or "").strip(), f"det-lab {' '.join(path)} has no description"
