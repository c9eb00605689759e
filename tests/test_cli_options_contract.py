"""Options mean one thing in every det-lab command: `--json` on every read, `--dry-run` (or a plan
that `--yes` carries out) on every command that deletes or replaces, `--out` a directory. A new
command that breaks the rule fails here, naming itself."""

from __future__ import annotations

from typing import Any

import pytest
import typer.main

from det_lab.cli.app import app

#: commands that only read: each prints its data as JSON with --json
READS = {"cluster logs", "cluster status", "config", "data list", "data status", "data verify", "doctor", "gpus",
         "runs diff", "runs list", "runs show", "slurm search", "templates list", "tracking status", "usage",
         "volume usage", "watchdog status"}
#: commands that delete or replace what is there: each shows its plan first
DELETES = {"cluster backup", "cluster down", "cluster restore", "data gc", "data import", "data register",
           "data verify", "runs delete", "runs prune", "slurm accounts"}
#: where --out names a file: none
OUT_FILE: set[str] = set()


def _commands() -> dict[str, Any]:
    found: dict[str, Any] = {}

    def walk(command: Any, path: list[str]) -> None:
        subs = getattr(command, "commands", None)
        if subs:
            for name, sub in subs.items():
                walk(sub, [*path, name])
        else:
            found[" ".join(path)] = command

    walk(typer.main.get_command(app), [])
    return found


COMMANDS = _commands()


def _options(name: str) -> dict[str, Any]:
    """The command's options by each spelling (typer's own click: its classes, not click's)."""
    return {opt: p for p in COMMANDS[name].params if p.param_type_name == "option" for opt in p.opts}


def test_the_listed_commands_exist():
    assert READS | DELETES | OUT_FILE <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(READS))
def test_every_read_takes_json(name):
    assert "--json" in _options(name), f"det-lab {name} reads but has no --json"


@pytest.mark.parametrize("name", sorted(DELETES))
def test_every_delete_shows_its_plan_first(name):
    opts = _options(name)
    assert "--dry-run" in opts or ("--yes" in opts and "plan" in (opts["--yes"].help or "")), (
        f"det-lab {name} deletes or replaces without --dry-run")


@pytest.mark.parametrize("name", sorted(n for n in COMMANDS if "--out" in _options(n) and n not in OUT_FILE))
def test_out_is_a_directory(name):
    assert "director" in (_options(name)["--out"].help or "").lower(), f"det-lab {name}: --out must name a directory"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_config_before_a_command_is_the_lab_config_only(name):
    """`--config` is the lab config (`det-lab --config lab.yaml ...`); a command's own file is
    `--exp-config`, `--cluster-config`, `--slurm-config` or `--lab-config`, an old spelling hidden."""
    option = _options(name).get("--config")
    assert option is None or option.hidden, (
        f"det-lab {name} --config names another kind of file")
