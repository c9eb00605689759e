"""Monitoring: a Prometheus exporter over det_lab's sources, and the Prometheus/Grafana files around it.

- :mod:`~det_lab.monitoring.collector`: the custom collector (fresh metrics per scrape, slow
  sources cached, one ``det_lab_scrape_error`` per source);
- one module per source: :mod:`~det_lab.monitoring.source_gpus` (NVML), :mod:`~det_lab.monitoring.source_slurm`
  (squeue, sinfo, sshare), :mod:`~det_lab.monitoring.source_volume`, :mod:`~det_lab.monitoring.source_runs`,
  :mod:`~det_lab.monitoring.source_trackers`;
- :mod:`~det_lab.monitoring.rules` and :mod:`~det_lab.monitoring.dashboards`: recording and alert
  rules, Grafana dashboards; :mod:`~det_lab.monitoring.render` renders them with prometheus.yml and
  systemd units; :mod:`~det_lab.monitoring.report` plots the dashboards from Prometheus.

Sits on det_lab's record and settings layers; nothing below it imports it.
"""
