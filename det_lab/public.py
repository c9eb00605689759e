"""What det_lab's users may build on: the Python names below, every ``det-lab`` command and option,
the environment variables of :data:`det_lab.settings.ENV_VARS` and the keys of the three config files.

A name here that changes keeps working for at least one minor release, with one
``DeprecationWarning`` (Python) or one stderr line (CLI) naming the new spelling and the release that
drops it (:data:`DEPRECATED`). ``tests/test_public_surface.py`` holds the code to the surface recorded
at the last release (``tests/fixtures/surface/<version>.json``); ``docs/reference/public-api.md`` is
generated from this module. Anything not listed is internal and may change in any release. A leaf
module: names as text, nothing imported.
"""

from __future__ import annotations

from typing import NamedTuple

#: module -> the public names in it (a trial's code, a notebook, a lab's scripts)
PYTHON: dict[str, tuple[str, ...]] = {
    "det_lab": ("__version__",),
    "det_lab.core": ("init", "LabContext", "local_checkpoint_dir"),
    "det_lab.trials.pytorch": ("LabPyTorchTrial", "run"),
    "det_lab.trials.surface": ("TrialSurface",),
    "det_lab.data": ("DataError", "DatasetIdentity", "DatasetSpec", "DatasetStatus", "ProjectListing",
                     "PulledDataset", "list_volume", "load_registry", "pull", "register", "register_plan",
                     "resolve", "status"),
    "det_lab.formats": ("Episode", "LeRobotDataset", "LeRobotDatasetError", "VideoDecoderMissing",
                        "split_episodes"),
    "det_lab.scenes": ("Camera", "ColmapError", "Scene", "View", "load_scene", "read_model", "render_key",
                       "render_keys"),
    "det_lab.notebook": ("CheckpointInfo", "SubmitError", "SubmitResult", "best_checkpoint", "dataset_revisions",
                         "det_template", "load_runs", "metric_histories", "registry_table", "save_figure",
                         "snapshots_table", "submit", "volume_table"),
    "det_lab.settings": ("LabSettings", "load_settings", "env_value", "ENV_VARS"),
    "det_lab.rl.supervisor": ("supervise", "Restore", "ChildCommand"),
    "det_lab.models": ("ModelMissing", "ModelStoreError", "import_model", "list_models", "require_model",
                       "show_model"),
    "det_lab.policies": ("PolicyChoice", "PolicyError", "parse_policy"),
    "det_lab.ondisk": ("FORMATS", "Format", "NewerFormat"),
    "det_lab.errors": ("UserError",),
}


class Deprecation(NamedTuple):
    """An old spelling that still works: what replaces it, since when, and the release that drops it."""

    new: str
    since: str
    removal: str


#: old spelling (a module, a name, or ``det-lab <command> <option>``) -> its deprecation
DEPRECATED: dict[str, Deprecation] = {
    "det_lab.datasets": Deprecation("det_lab.formats", "0.2.0", "0.3.0"),
    "det-lab run --config": Deprecation("det-lab run --exp-config", "0.2.0", "0.3.0"),
    "det-lab slurm ci --config": Deprecation("det-lab slurm ci --exp-config", "0.2.0", "0.3.0"),
    # the run layer and the volume's lifecycle, out of det_lab.trials (det_lab.trials.MOVED imports them)
    **{f"det_lab.trials.{name}": Deprecation(f"det_lab.runs.{name}", "0.2.0", "0.3.0") for name in (
        "base_models", "cachefile", "expconf", "fence", "harness", "identity", "lineage", "listing", "local",
        "record", "retention", "run_guard", "run_state", "validate")},
    **{f"det_lab.trials.{name}": Deprecation(f"det_lab.lifecycle.{name}", "0.2.0", "0.3.0")
       for name in ("prune", "space", "storage", "trees")},
}
