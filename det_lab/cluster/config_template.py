"""Registering a config template with the master: created when new, updated when it exists.

Determined 0.38.1's master refuses to create a template whose name exists
(``master/internal/templates/api.go`` ``PostTemplate``, ~l.167-204: a plain insert into the
``templates`` table, whose name is unique); replacing one's config is ``PatchTemplateConfig``
(~l.250-285), which ``det template set-value config`` calls
(``harness/determined/cli/template.py`` ``patch_template_config``). So ``det-lab cluster template
--apply`` asks whether the name exists (``det template describe``, ``GetTemplate``: NotFound when
it does not) and then creates or updates: running it again after a lab config change updates the
template instead of failing.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from det_lab.cluster.render import publish_task_config
from det_lab.errors import UserError
from det_lab.settings import LabSettings

DET_TIMEOUT_S = 60


class TemplateApplyError(UserError):
    """``det`` could not create or update the template; the message is its last line."""


def _det(det: str, master: str, args: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([det, "-m", master, "template", *args], env=dict(env), capture_output=True,
                          text=True, timeout=DET_TIMEOUT_S)


def _reason(proc: subprocess.CompletedProcess[str]) -> str:
    text = proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}"
    return text.splitlines()[-1]


def apply_template(det: str, master: str, name: str, path: Path, env: Mapping[str, str],
                   lab: LabSettings | None = None) -> Literal["created", "updated"]:
    """Create template ``name`` from the YAML file ``path`` on ``master``, or replace its config
    when the master already has one of that name; which of the two it did. With ``lab``, first
    the copy of the lab config the template's tasks read (``DET_LAB_CONFIG``) is written."""
    if lab is not None:
        publish_task_config(lab)
    exists = _det(det, master, ["describe", name], env).returncode == 0
    if exists:
        proc = _det(det, master, ["set-value", "config", name, str(path)], env)
        if proc.returncode != 0:
            raise TemplateApplyError(f"det template set-value config {name}: {_reason(proc)}")
        return "updated"
    proc = _det(det, master, ["create", name, str(path)], env)
    if proc.returncode != 0:
        raise TemplateApplyError(f"det template create {name}: {_reason(proc)}")
    return "created"
