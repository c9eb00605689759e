"""A ``.gitlab-ci.yml`` for a team's training repository: tests, a smoke run, then the real run.

Stages: ``test`` (lint and the repository's own tests), ``smoke`` (``det-lab run --local`` with a
tiny ``--set``: the config, data and code work end to end in a minute), ``train`` on the default
branch: ``det-lab run --slurm --wait`` (the job's outcome is the CI job's outcome), or, where a
Determined master is configured (``DET_MASTER``), ``det experiment create --follow-first-trial``.
The jobs run on a GitLab shell runner on a Slurm login node with the lab volume mounted and
det_lab installed (runner tag ``det-lab``).
"""

from __future__ import annotations

from typing import Any

import yaml

SMOKE_SETS = ("--set data.det_lab.max_length.batches=20 --set min_validation_period.batches=10 "
              "--set min_checkpoint_period.batches=20")


def render_gitlab_ci(template: str = ".", config: str = "const.yaml", lab_config: str = "/etc/det-lab/lab.yaml",
                     runner_tag: str = "det-lab") -> dict[str, Any]:
    """The pipeline as a mapping (``yaml.safe_dump`` writes the file)."""
    on_default = "$CI_COMMIT_BRANCH == $CI_DEFAULT_BRANCH"
    return {
        "variables": {
            "TEMPLATE": {"value": template, "description": "experiment directory, or a det_lab template name"},
            "CONFIG": {"value": config, "description": "experiment config"},
            "SMOKE_SETS": {"value": SMOKE_SETS, "description": "--set overrides that make the smoke run tiny"},
            "DET_LAB_CONFIG": lab_config,
        },
        "stages": ["test", "smoke", "train"],
        "default": {"tags": [runner_tag], "interruptible": True},
        "lint": {"stage": "test", "script": ["python -m ruff check ."]},
        "tests": {"stage": "test", "script": ["python -m pytest -q"]},
        "smoke": {"stage": "smoke",
                  "script": ['det-lab run "$TEMPLATE" --local --exp-config "$CONFIG" $SMOKE_SETS']},
        "train": {
            "stage": "train",
            "rules": [{"if": f"{on_default} && $DET_MASTER == null"}],
            "interruptible": False,
            "timeout": "3 days",
            "script": ['det-lab run "$TEMPLATE" --slurm --wait --exp-config "$CONFIG"'],
        },
        "train-determined": {
            "stage": "train",
            "rules": [{"if": f"{on_default} && $DET_MASTER"}],
            "interruptible": False,
            "timeout": "3 days",
            "script": ['det experiment create --follow-first-trial "$CONFIG" "$TEMPLATE"'],
        },
    }


def render_text(**kwargs: str) -> str:
    header = "# .gitlab-ci.yml rendered by 'det-lab slurm ci' (see det_lab/slurm/ci.py for what each job does)\n"
    return header + yaml.safe_dump(render_gitlab_ci(**kwargs), sort_keys=False, width=200)
