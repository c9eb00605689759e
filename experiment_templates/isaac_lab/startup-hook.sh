#!/usr/bin/env bash
# det_lab's startup hook, one script for every template (tests/test_task_standin.py checks the copies
# are this one). Determined *sources* startup-hook.sh in the task's shell, after `set -e`, before the
# trial starts (master/static/srv/entrypoint.sh): so no `exit`, no `set -u`/`pipefail`, and no
# variables left behind. A pip install that fails returns non-zero, which ends the task with pip's
# message; with nothing to install from it says so and returns, and the trial's own import of det_lab
# then fails below that message (the hook never ends the task's shell itself).
#
# It makes det_lab importable by the task's Python ($DET_PYTHON_EXECUTABLE, as Determined's
# task-setup.sh picks it) when the image lacks it; with the lab's task image it does nothing. From:
#   $DET_LAB_WHEELS                       a directory of wheels (environment_variables)
#   $DET_LAB_DATA_ROOT/.det-lab/wheels    the wheelhouse on the shared volume
#   $DET_LAB_PIP_SPEC                     a pip requirement (a wheel path or a git URL)
# Fill a wheelhouse once, on a machine with the same Python as the task image:
#   pip wheel --wheel-dir <data_root>/.det-lab/wheels det-lab
# The wheelhouse install is offline (--no-index): it must hold det_lab and what the image lacks.
_det_lab_startup_hook() {
  local py="${DET_PYTHON_EXECUTABLE:-python3}" wheels="" candidate
  # The master copies its own version's harness wheel here and task-setup.sh has just installed it
  # over the image's (master/pkg/tasks/copy.go:35-75, task-setup.sh:26-27): det_lab's trials patch
  # and call Determined 0.38's harness, so a task under another master's harness stops here, in one line.
  for candidate in "${DET_LAB_HARNESS_WHEELS:-/opt/determined/wheels}"/determined-*.whl; do
    case "${candidate##*/}" in
      "determined-*.whl"|determined-0.38.*) ;;
      *) if [ -z "${DET_LAB_UNTESTED_HARNESS:-}" ]; then
           echo "startup-hook.sh: this master runs tasks under Determined's harness ${candidate##*/};" \
                "det_lab supports the 0.38 harness only (docs/admin/fork.md): run a 0.38.1 master, or set" \
                "DET_LAB_UNTESTED_HARNESS=1 in environment_variables to try it anyway" >&2
           return 1
         fi ;;
    esac
  done
  if "$py" -c "import det_lab" 2>/dev/null; then
    return 0
  fi
  for candidate in "${DET_LAB_WHEELS:-}" "${DET_LAB_DATA_ROOT:+$DET_LAB_DATA_ROOT/.det-lab/wheels}"; do
    if [ -n "$candidate" ] && compgen -G "$candidate/det_lab-*.whl" >/dev/null; then
      wheels=$candidate
      break
    fi
  done
  if [ -n "$wheels" ]; then
    echo "startup-hook.sh: installing det_lab from $wheels"
    "$py" -m pip install --quiet --user --no-index --find-links "$wheels" det_lab || return 1
  elif [ -n "${DET_LAB_PIP_SPEC:-}" ]; then
    echo "startup-hook.sh: installing $DET_LAB_PIP_SPEC"
    "$py" -m pip install --quiet --user --no-cache-dir "$DET_LAB_PIP_SPEC" || return 1
  else
    echo "startup-hook.sh: det_lab is not installed in this image ($py) and there is nothing to install it from:" \
         "looked in \$DET_LAB_WHEELS='${DET_LAB_WHEELS:-}', \$DET_LAB_DATA_ROOT/.det-lab/wheels" \
         "(DET_LAB_DATA_ROOT='${DET_LAB_DATA_ROOT:-}') and \$DET_LAB_PIP_SPEC; use the lab's task image or" \
         "fill the wheelhouse (see the template's README)" >&2
    return 0
  fi
  "$py" -c "import det_lab; print('startup-hook.sh: det_lab', det_lab.__version__)" || return 1
}
_det_lab_startup_hook || { unset -f _det_lab_startup_hook; false; }
unset -f _det_lab_startup_hook
