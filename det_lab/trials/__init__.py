"""Trial base classes: subclass, and get the dataset pulled, checkpoints on the volume, every
metric mirrored to MLflow/Aim with lineage, correct resume, on a cluster and on a laptop.

- :class:`det_lab.trials.pytorch.LabPyTorchTrial` with :func:`det_lab.trials.pytorch.run`
  (script entrypoint) or the legacy ``module:Class`` entrypoint;
- :func:`det_lab.core.init` for training loops that are not PyTorchTrials.

Both offer the same names to trial code (:mod:`.surface`). Inside, one module per concern:
:mod:`.identity` (who the trial is), :mod:`.record` (its files), :mod:`.lineage`,
:mod:`.harness` (everything that touches Determined's internals), composed by :mod:`.session`;
:mod:`.expconf` reads det_lab's part of the experiment config and :mod:`.local` starts
``det-lab run --local`` runs.
"""
