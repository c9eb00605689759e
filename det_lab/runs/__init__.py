"""The run layer: what a run is on the volume and how a local-style run starts.

One module per concern: :mod:`.identity` (who the run is, on a cluster or off it), :mod:`.expconf`
(det_lab's part of the experiment config), :mod:`.record` and :mod:`.run_state` (its files and
state), :mod:`.lineage`, :mod:`.fence` (one writer per run), :mod:`.run_guard` (one trainer),
:mod:`.retention` (the run's own checkpoint policy), :mod:`.listing` (every run of a volume),
:mod:`.validate` and :mod:`.base_models` (preflight), :mod:`.local` (``det-lab run --local``),
:mod:`.harness` (everything that touches Determined's internals), :mod:`.cachefile`.

Trial code does not import these: it sees :mod:`det_lab.trials` and :mod:`det_lab.core`.
"""
