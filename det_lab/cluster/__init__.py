"""A Determined cluster without Kubernetes, built on ``det deploy local`` and the shared volume.

Modules, one job each:

- :mod:`~det_lab.cluster.settings`: the cluster section (``<data_root>/.det-lab/cluster.yaml``),
- :mod:`~det_lab.cluster.render`: master.yaml and agent.yaml rendered from lab + cluster settings,
- :mod:`~det_lab.cluster.schema`: structural validation of those files against the documented fields,
- :mod:`~det_lab.cluster.secrets`: the admin and database passwords, in owner-only files,
- :mod:`~det_lab.cluster.plan`: what ``up``/``agent-up`` would create, as data (``--dry-run``),
- :mod:`~det_lab.cluster.deploy`: running the plan through Determined's own deploy code,
- :mod:`~det_lab.cluster.users`: mapping cluster users to Unix uid/gid (``link-users``).
"""
