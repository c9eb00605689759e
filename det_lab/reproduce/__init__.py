"""Reproducing a recorded run and comparing two runs, from the lineage det_lab records.

On top of the record layer (:mod:`det_lab.runs.record`, :mod:`det_lab.runs.lineage`) and
the settings; nothing below imports it.

- :mod:`.find`: a run's lineage from its name, a checkpoint UUID, an MLflow run id or Aim run hash
- :mod:`.code`: a scratch git worktree at the recorded commit, the saved patch applied
- :mod:`.envdiff`: the recorded Python environment against this one
- :mod:`.rerun`: the same config, seed and dataset revision as a new run
- :mod:`.compare`: step-by-step metric comparison and the verdict
- :mod:`.diff`: what differs between two runs (``det-lab runs diff``)
"""
