#!/usr/bin/env bash
# Determined runs this from the context directory before the entrypoint, in every task container.
# It makes det_lab importable when the task image lacks it; otherwise it does nothing.
#
# Where the wheels come from (first that exists):
#   $DET_LAB_WHEELS                               a directory of wheels (task environment_variables)
#   $DET_LAB_DATA_ROOT/.det-lab/wheels            the wheelhouse on the shared volume
# Fill a wheelhouse once, on a machine with the same Python as the task image:
#   pip wheel --wheel-dir <data_root>/.det-lab/wheels /path/to/det_lab
# The install is offline (--no-index): the wheelhouse must hold det_lab and whatever of its
# dependencies the image lacks (Isaac Sim's Python already has torch; add determined and its dependencies).
set -euo pipefail

py=python3
[ -x /isaac-sim/python.sh ] && py=/isaac-sim/python.sh  # Isaac Sim's Python runs the supervisor
if "$py" -c "import det_lab" 2>/dev/null; then
  exit 0
fi

wheels=""
for candidate in "${DET_LAB_WHEELS:-}" "${DET_LAB_DATA_ROOT:+$DET_LAB_DATA_ROOT/.det-lab/wheels}"; do
  if [ -n "$candidate" ] && compgen -G "$candidate/det_lab-*.whl" >/dev/null; then
    wheels=$candidate
    break
  fi
done
if [ -z "$wheels" ]; then
  echo "startup-hook.sh: det_lab is not installed in this image and no wheelhouse was found" >&2
  echo "  looked in: \$DET_LAB_WHEELS='${DET_LAB_WHEELS:-}' and \$DET_LAB_DATA_ROOT/.det-lab/wheels" \
       "(DET_LAB_DATA_ROOT='${DET_LAB_DATA_ROOT:-}')" >&2
  echo "  fix: use a task image with det_lab, or put its wheels there (see experiment_templates/isaac_lab/README.md)" >&2
  exit 1
fi

echo "startup-hook.sh: installing det_lab from $wheels"
"$py" -m pip install --quiet --no-index --find-links "$wheels" det_lab
"$py" -c "import det_lab; print('startup-hook.sh: det_lab', det_lab.__version__)"
