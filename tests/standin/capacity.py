"""The master stand-in's capacity check when an experiment is created: Determined 0.38.1's agent
resource manager (determined-ai/determined v0.38.1 ``path:line``), over the agents connected to the
stand-in (``State.agent_slots``: tests/standin/agent.py and agents.py register theirs)."""

from __future__ import annotations

from typing import Any

#: harness/determined/common/api/_util.py:24-28 WARNING_MESSAGE_MAP (what ``det`` prints for it)
SLOTS_EXCEEDED = "LAUNCH_WARNING_CURRENT_SLOTS_EXCEEDED"


def validate_resources(master_config: dict[str, Any], agent_slots: dict[str, int], slots: int,
                       single_node: bool) -> list[str]:
    """What 0.38.1 checks when it creates an experiment (experiment.go:117-128 newExperiment, only for a
    new one): agent_resource_manager.go:527-557 ValidateResources. ``is_single_node``: refused unless one
    connected agent has ``slots`` (resource_pool.go:568-593); otherwise more slots than the connected
    agents have together (CapacityCheck, resource_pool.go:607-660, a pool without a provider) is a
    launch warning, and an error while the master's ``launch_error`` is on (its default, config.go:149).
    ValueError with newExperiment's message; else the warnings."""
    if slots == 0:
        return []
    if single_node:
        if max(agent_slots.values(), default=0) < slots:
            raise ValueError("validating resources: request unfulfillable, please try requesting less slots")
        return []
    if sum(agent_slots.values()) >= slots:
        return []
    if master_config.get("launch_error", True):
        raise ValueError("slots requested exceeds cluster capacity")
    return [SLOTS_EXCEEDED]
