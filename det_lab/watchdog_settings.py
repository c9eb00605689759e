"""The lab config's ``watchdog:`` section: when a held GPU counts as idle, and what is done about it.

A leaf module (pydantic only): :mod:`det_lab.settings` nests :class:`WatchdogSettings` in the lab
config, and :mod:`det_lab.watchdog` applies it. Durations are seconds or text such as ``90s``,
``60m``, ``2h``, ``1d``.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> float:
    """Seconds in ``value``: a number of seconds, or text such as ``90s``, ``60m``, ``2h``, ``1d``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"{value!r} is not a duration such as 90s, 60m, 2h or 1d")
        seconds = float(m.group(1)) * _SECONDS[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"{value!r} must be a positive duration")
    return seconds


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IdleRule(_Section):
    """When a GPU's holder counts as idle and what follows (lab-wide, or one partition's changes)."""

    window: float = Field(3600.0, description="sliding window the means are taken over (e.g. 60m)")
    utilization_below: float = Field(5.0, ge=0, le=100, description="idle when the window's mean GPU "
                                     "utilization (percent) is under this")
    memory_below: float = Field(100.0, ge=0, le=100, description="and the window's mean memory in use (percent "
                                "of the GPU's) is under this; 100: memory held never spares a GPU")
    grace: float = Field(1800.0, description="time between the warning and the action, for the holder to "
                         "resume work or snooze")
    cancel_batch_jobs: bool = Field(False, description="also cancel another tool's Slurm batch job (sbatch); "
                                    "otherwise it is only warned")
    act: bool = Field(True, description="false: warn only, never stop anything")

    @field_validator("window", "grace", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)


class Exemption(_Section):
    """Holders the watchdog leaves alone until a date: every field given must match."""

    user: str | None = Field(None, description="Unix user whose GPUs are exempt")
    partition: str | None = Field(None, description="Slurm partition (or Determined resource pool) exempt")
    job_name: str | None = Field(None, description="job or run name, a shell pattern such as 'bench-*'")
    until: dt.datetime = Field(description="the exemption ends at this date (YYYY-MM-DD[THH:MM])")
    reason: str = Field("", description="why, shown in 'det-lab watchdog status'")

    @field_validator("until")
    @classmethod
    def _local(cls, v: dt.datetime) -> dt.datetime:
        # compared with the machine's local time, as a date without a zone is read
        return v.astimezone().replace(tzinfo=None) if v.tzinfo else v

    def matches(self, user: str, partition: str, name: str) -> bool:
        """Whether this exemption names a holder of ``user``, ``partition`` and ``name`` (expiry aside)."""
        return ((self.user is None or self.user == user) and (self.partition is None or self.partition == partition)
                and (self.job_name is None or fnmatch.fnmatchcase(name, self.job_name)))


class WebhookSettings(_Section):
    """An incoming webhook the warnings are posted to."""

    url: str = Field(description="the incoming webhook's URL")
    kind: Literal["slack", "mattermost", "matrix"] = Field("slack", description="JSON shape: slack and mattermost "
                                                          "{text}; matrix: matrix-hookshot's generic webhook {text, username}")


class MailSettings(_Section):
    """Warnings mailed to the holder through the machine's sendmail."""

    domain: str = Field(description="mail goes to <user>@<domain>")
    sender: str = Field("det-lab-watchdog", description="From: address (a bare name gets @<domain>)")
    sendmail: Path = Field(Path("/usr/sbin/sendmail"), description="the MTA's sendmail program")
    cc: list[str] = Field(default_factory=list, description="addresses copied on every warning (the admins)")


class WatchdogSettings(_Section):
    """``det-lab watchdog``: GPUs held and idle are warned about, then stopped (see docs/admin/watchdog.md)."""

    interval: float = Field(30.0, description="seconds between two samples of the GPUs")
    rule: IdleRule = Field(default_factory=IdleRule, description="the lab-wide idle rule")
    partitions: dict[str, IdleRule] = Field(default_factory=dict, description="per Slurm partition: the keys "
                                            "given replace the lab-wide rule's")
    exemptions: list[Exemption] = Field(default_factory=list, description="holders left alone until a date")
    snooze_limit: float = Field(8 * 3600.0, description="the longest 'det-lab watchdog snooze' a holder may ask")
    webhook: WebhookSettings | None = Field(None, description="post warnings to this incoming webhook")
    mail: MailSettings | None = Field(None, description="mail warnings to the holder")
    master_token_file: Path | None = Field(None, description="a Determined session token (det-lab monitor token "
                                           "writes one) for killing idle notebooks and shells")

    @field_validator("interval", "snooze_limit", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    def rule_for(self, partition: str) -> IdleRule:
        """The rule of ``partition``: the lab-wide one with that partition's keys replaced."""
        override = self.partitions.get(partition)
        if override is None:
            return self.rule
        return self.rule.model_copy(update=override.model_dump(exclude_unset=True))

    def exemption_for(self, user: str, partition: str, name: str, now: dt.datetime) -> Exemption | None:
        """The first exemption in force at ``now`` for this holder, or None."""
        return next((e for e in self.exemptions if e.matches(user, partition, name) and now < e.until), None)
