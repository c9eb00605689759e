#!/usr/bin/env bash
# Sets up everything the test suite uses, into the current Python environment (use a venv), on a
# fresh Debian/Ubuntu machine: the Debian packages of the services the tests start (installed with
# apt-get when this runs as root or with password-less sudo; otherwise it names what is missing and
# the tests that need it skip, each naming its package), det_lab with its test extras, and the
# packages that install without their declared dependencies. README command 2 and .ci/run call it.
set -euo pipefail
cd "$(dirname "$0")/.."

# package: what needs it (a test that cannot find it skips and names the package)
DEBIAN_PACKAGES=(
  slurm-wlm       # slurmctld, slurmd, sbatch...: tests/slurm_cluster.py
  munge           # Slurm's authentication
  slurmdbd        # Slurm accounting (tests/slurm_cluster.py, accounting tests)
  mariadb-server  # slurmdbd's database
  prometheus      # prometheus + promtool: monitoring tests
  postgresql      # a real PostgreSQL standing in for the Determined master's (cluster backups)
  bubblewrap      # bwrap: the Determined trial container's stand-in (tests/task_standin.py)
  sshfs           # the multi-host test bed's network volume (tests/multihost.py, multihost_sshfs)
  fuse3           # sshfs's FUSE
  openssh-sftp-server  # the volume's file server there (/usr/lib/openssh/sftp-server)
  socat           # which hands each connection to an sftp-server
)
# FFmpeg's shared libraries for torchcodec (LeRobot's and det_lab's video decoder); without their
# recommends, which are codecs' hardware drivers the tests do not use
DEBIAN_LIBRARIES=(libavcodec59 libavformat59 libavutil57 libswscale6 libswresample4 libavdevice59 libavfilter8)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=() missing_libs=()
if command -v dpkg-query >/dev/null; then
  for p in "${DEBIAN_PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
  for p in "${DEBIAN_LIBRARIES[@]}"; do installed "$p" || missing_libs+=("$p"); done
fi
if [ $((${#missing[@]} + ${#missing_libs[@]})) -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO="none"; fi
  if [ "$SUDO" = none ] || ! command -v apt-get >/dev/null; then
    echo "tests/setup.sh: cannot install the Debian packages ${missing[*]} ${missing_libs[*]} (needs root or sudo, and apt-get):" \
         "the tests that use them will skip, each naming its package" >&2
  else
    echo "tests/setup.sh: installing ${missing[*]} ${missing_libs[*]}" >&2
    # the tests start private daemons in temp dirs on free ports, whatever apt-get starts
    $SUDO apt-get update -q
    [ ${#missing[@]} -eq 0 ] || $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
    [ ${#missing_libs[@]} -eq 0 ] ||
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing_libs[@]}"
  fi
elif ! command -v dpkg-query >/dev/null; then
  echo "tests/setup.sh: not a Debian system: install Slurm (with slurmdbd), munge, MariaDB, Prometheus," \
       "PostgreSQL and FFmpeg's libraries yourself; the tests that need one skip, naming it" >&2
fi

python -m pip install -q --upgrade pip
# a plain 'torch' requirement pulls a multi-GB CUDA build: take the pinned one unless torch is there
python -c 'import torch' 2>/dev/null || python -m pip install -q 'torch==2.13.0'
python -m pip install -q -e '.[test,docs]'
# without their declared dependencies: rsl_rl's tensorboard/onnx (not needed to train), LeRobot's
# torch<2.11 pin (its dataset code and its policies are the tests' references; what they import is in
# the test extra), and `datasets` 4's requests>=2.32 (determined 0.38.1 pins requests<2.32)
python -m pip install -q --no-deps 'rsl-rl-lib==5.5.1' 'lerobot==0.4.4' 'datasets==4.8.5'

# LeRobot 0.5+ (the first releases whose pi0/pi0.5 run on PyPI's transformers: tests/test_vla_pi.py)
# needs Python 3.12: a second environment, .venv-lerobot06, where a Python 3.12 is installed (on
# PATH, or pyenv's). No CPU build of torch 2.13.0 for 3.12 lies on this index: PyPI's (CUDA 13,
# about 4.7 GB installed with its CUDA libraries) runs on the CPU, and PyPI's torchvision matches it.
py312=""
for cand in python3.12 "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12; do
  if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then py312=$cand; break; fi
done
if [ -n "$py312" ]; then
  [ -x .venv-lerobot06/bin/python ] || "$py312" -m venv .venv-lerobot06
  .venv-lerobot06/bin/python -m pip install -q --upgrade pip
  .venv-lerobot06/bin/python -m pip install -q 'torch==2.13.0' -e . -r tests/lerobot06-requirements.txt
  .venv-lerobot06/bin/python -m pip install -q --no-deps 'lerobot==0.6.1' 'datasets==4.8.5'
else
  echo "tests/setup.sh: no Python 3.12 here (python3.12 or pyenv's): tests/test_vla_pi.py, LeRobot 0.6's" \
       "pi0/pi0.5, will skip" >&2
fi
echo "tests/setup.sh: ready; run: python -m pytest" >&2
