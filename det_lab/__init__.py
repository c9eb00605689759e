"""det_lab: a small robotics ML team's training platform on Determined, one NFS volume, DVC and
MLflow/Aim.

The package reads top-down: :mod:`det_lab.settings` (the lab config) → :mod:`det_lab.volume`
(the shared data volume) → data → tracking → trials → cluster and templates → :mod:`det_lab.cli`.
"""

#: semantic version, raised with each wave's user-visible changes (CHANGELOG.md); the one place it is declared
__version__ = "0.2.0"
