"""What the ``det-lab cluster`` commands share: the cluster config named by ``--cluster-config``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from det_lab.cli.common import fail, state

if TYPE_CHECKING:
    from det_lab.cluster.settings import ClusterSettings
    from det_lab.settings import LabSettings

#: where the group's callback keeps --cluster-config for its commands
META_KEY = "det_lab.cluster_config"


def load(ctx: typer.Context, master: str | None = None) -> tuple[LabSettings, ClusterSettings]:
    """The lab settings and the cluster config (``master`` overriding its master host and port)."""
    from pydantic import ValidationError

    from det_lab.cluster.settings import ClusterSettings, load_cluster_settings

    lab = state(ctx).settings
    cluster = load_cluster_settings(lab, ctx.meta.get(META_KEY))
    if master:
        host, _, port = master.removeprefix("http://").rstrip("/").partition(":")
        update: dict = {"master_host": host}
        if port:
            if not port.isdigit() or not 0 < int(port) < 65536:
                fail(f"MASTER {master!r}: the port must be a number 1-65535")
            update["master_port"] = int(port)
        try:
            cluster = ClusterSettings.model_validate({**cluster.model_dump(), **update, "source": cluster.source})
        except ValidationError as exc:
            fail(f"MASTER {master!r}: {str(exc).splitlines()[-1].strip()}")
    return lab, cluster
