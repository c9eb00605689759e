"""Accounting on Slurm: who is in the lab, their GPU limits and shares, and who used the GPUs on what.

Built on the Slurm settings (:mod:`det_lab.slurm.settings`, the ``accounting:`` section) and
det_lab's run records; it talks to Slurm only through its commands (``sacctmgr -i -P``, ``sacct``,
``squeue``), as an administrator would.

- :mod:`det_lab.accounting.slurm_accounts`: makes Slurm's associations match the lab config (``det-lab slurm accounts``);
- :mod:`det_lab.accounting.limits`: a run's limits before submission, and Slurm's pending reasons in words;
- :mod:`det_lab.accounting.usage`: GPU-hours from ``sacct`` joined with the run records (``det-lab usage``).
"""
