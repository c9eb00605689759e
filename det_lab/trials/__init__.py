"""Trial base classes: subclass, and get the dataset pulled, checkpoints on the volume, every
metric mirrored to MLflow/Aim with lineage, correct resume, on a cluster and on a laptop.

- :class:`det_lab.trials.pytorch.LabPyTorchTrial` with :func:`det_lab.trials.pytorch.run`
  (script entrypoint) or the legacy ``module:Class`` entrypoint;
- :func:`det_lab.core.init` for training loops that are not PyTorchTrials.
"""
