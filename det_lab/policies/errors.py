"""The one error of det_lab's LeRobot policy glue: a bad policy choice or a dataset it cannot train on."""

from __future__ import annotations

from det_lab.errors import UserError


class PolicyError(UserError, ValueError):
    """An unknown policy type, a bad policy key or value, a missing pretrained model, or a dataset
    without a feature the policy needs; one line naming what to change."""
