"""det_lab: a small robotics ML team's training platform on Determined, one NFS volume, DVC and
MLflow/Aim.

The package reads top-down: :mod:`det_lab.settings` (the lab config) → :mod:`det_lab.volume`
(the shared data volume) → data → tracking → trials → cluster and templates → :mod:`det_lab.cli`.
"""

__version__ = "0.1.0"
