"""Slurm as det_lab's second scheduler: cluster configs, job scripts, searches, images, CI."""
