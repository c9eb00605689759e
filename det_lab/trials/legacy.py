"""Local runs of the legacy ``entrypoint: module:Class`` form: ``python -m det_lab.trials.legacy
model_def:MyTrial`` imports the class from the working directory and trains it with
:func:`det_lab.trials.pytorch.run`."""

from __future__ import annotations

import importlib
import sys


def main(argv: list[str]) -> None:
    if len(argv) != 1 or ":" not in argv[0]:
        raise SystemExit("usage: python -m det_lab.trials.legacy module:Class")
    module_name, class_name = argv[0].split(":")
    sys.path.insert(0, ".")
    trial_cls = getattr(importlib.import_module(module_name), class_name)
    from det_lab.trials.pytorch import run

    run(trial_cls)


if __name__ == "__main__":
    main(sys.argv[1:])
