"""What the notebooks in ``notebooks/`` call, so that they stay short and the logic is tested code.

    from det_lab import notebook as nb
    result = nb.submit("vla")             # a cluster when its master answers, else a local run
    nb.best_checkpoint(result).path
    runs = nb.load_runs()                 # MLflow or Aim runs as a DataFrame, each linked to its trial
    nb.metric_histories(runs, ["training/loss"])

One module per job: :mod:`.submit` (where to run, submit and watch, best checkpoint),
:mod:`.datasets` (the volume's datasets as tables), :mod:`.runs` (tracked runs, read back by
each tracker's reader) and :mod:`.plots` (:func:`save_figure` keeps each plot and the data
drawn in it under :func:`output_dir`).

Parameters come from environment variables so a notebook can be pointed elsewhere without edits:
``DET_LAB_NOTEBOOK_OUT`` (where plots go), ``DET_LAB_NOTEBOOK_CONFIG`` (the experiment config
:func:`submit` uses), ``DET_LAB_NOTEBOOK_TRACKER`` (``mlflow`` or ``aim``), ``DET_LAB_DET_TEMPLATE``
(the config template registered with the master, ``det-lab``), and the lab's own variables
(``DET_LAB_CONFIG``, ``DET_LAB_DATA_ROOT``, ``MLFLOW_TRACKING_URI``, ``DET_LAB_MASTER``...).
"""

from det_lab.notebook.datasets import dataset_revisions, registry_table, snapshots_table, volume_table
from det_lab.notebook.plots import OUT_ENV, output_dir, save_figure
from det_lab.notebook.runs import TRACKER_ENV, load_runs, metric_histories, tracker_name
from det_lab.notebook.submit import (
    CONFIG_ENV,
    DET_TEMPLATE_ENV,
    CheckpointInfo,
    SubmitError,
    SubmitResult,
    best_checkpoint,
    choose_mode,
    det_template,
    local_result,
    master_reachable,
    master_url,
    submit,
)

__all__ = [
    "CONFIG_ENV", "DET_TEMPLATE_ENV", "OUT_ENV", "TRACKER_ENV", "CheckpointInfo", "SubmitError", "SubmitResult",
    "best_checkpoint", "choose_mode", "dataset_revisions", "det_template", "load_runs", "local_result",
    "master_reachable", "master_url", "metric_histories", "output_dir", "registry_table", "save_figure",
    "snapshots_table", "submit", "tracker_name", "volume_table",
]
