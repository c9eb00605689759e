"""The volume's lifecycle: what a volume holds, and taking away what nothing needs.

:mod:`.storage` (checkpoint storage and what each run holds), :mod:`.trees` (the volume's trees),
:mod:`.space` (``det-lab volume usage``), :mod:`.prune` (``det-lab runs prune``: a plan first,
nothing a running run or a recorded lineage needs). Built on :mod:`det_lab.runs`; trial code never
imports it.
"""
