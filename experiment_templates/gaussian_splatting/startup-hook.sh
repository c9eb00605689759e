#!/usr/bin/env bash
# Determined runs (sources) this in every task container before train.py, so it uses no
# `exit` and no `set -e`. The template needs det_lab: a task image built for the lab has it and
# this is a no-op. Otherwise it installs DET_LAB_PIP_SPEC (a wheel on the shared volume or a
# git URL, set under environment.environment_variables); it never guesses a package name.
if ! python3 -c "import det_lab" 2>/dev/null; then
  if [ -n "${DET_LAB_PIP_SPEC:-}" ]; then
    python3 -m pip install --no-cache-dir --quiet "${DET_LAB_PIP_SPEC}"
  else
    echo "startup-hook: det_lab is not importable in this image; use the lab's task image or set" \
         "DET_LAB_PIP_SPEC to a det_lab wheel or git URL" >&2
  fi
fi
