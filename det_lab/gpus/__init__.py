"""This machine's GPUs shared between members without a scheduler: leases, a fair queue, an audit trail.

``det-lab run --local`` holds a lease on the GPUs it trains on (:class:`LocalClaim`), waits in a fair
line with ``--queue``, and every lease's start and end is journaled on the volume; ``det-lab gpus``
shows the GPUs, their holders and the line (:func:`gpus_status`). The watchdog and the exporter read
:func:`active_leases`.
"""

from det_lab.gpus.claim import LocalClaim
from det_lab.gpus.leases import Lease, active_leases
from det_lab.gpus.queue import GpusError
from det_lab.gpus.status import cancel_waiting, gpus_status, waiting_words

__all__ = ["GpusError", "Lease", "LocalClaim", "active_leases", "cancel_waiting", "gpus_status", "waiting_words"]
