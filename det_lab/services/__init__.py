"""What one ``det-lab`` command does when it needs several packages that do not know each other:
the layer between the packages and ``cli/`` (dstack's ``services/`` under its thin ``commands/``).

- :mod:`.launch`: ``det-lab run --slurm`` and a Slurm rerun: the account checked against Slurm
  accounting's limits, the run recorded and submitted, its job followed.
- :mod:`.runs`: a run as ``det-lab runs`` shows it: its live status (Slurm's, the trainer lock's), why
  it waits (the GPU line, Slurm's limits), where it ran.
- :mod:`.usage`: ``det-lab usage``: accounting's jobs joined with the run records and the
  watchdog's idle hours.

A ``cli/`` command parses its options, calls one function here (or of a package) and prints.
"""
