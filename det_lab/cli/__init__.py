"""The ``det-lab`` command line: one module per command group, assembled in :mod:`.app`."""
