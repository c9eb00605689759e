"""A volume shared by two real Unix users of one group, each with the usual umask 022 and a
personal primary group: what one writes through det-lab (the layout, a local run's directory,
its checkpoints, outputs and tracking journal, dataset pulls and their locks) the other can
resume, clean up and delete."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import sys
import sysconfig

import pytest
import yaml

from det_lab.data.publish import publish_directory
from det_lab.settings import load_settings

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd"),
    reason="needs root and useradd to make two real Unix users in one group",
)

TINY_PYTORCH_TRIAL = Path(__file__).parent / "fixtures" / "tiny"
TRIAL = """\
import json, os, pathlib
import det_lab.core

with det_lab.core.init() as ctx:
    start = 0
    if ctx.latest_checkpoint:
        with ctx.checkpoint.restore_path(ctx.latest_checkpoint) as path:
            start = json.loads((pathlib.Path(path) / "state.json").read_text())["step"]
    stop_at = int(os.environ.get("STOP_AT", "0")) or None
    for step in range(start + 1, 41):
        if step % 5 == 0:
            ctx.train.report_training_metrics(step, {"loss": 1.0 / step})
        if step % 10 == 0:
            ctx.train.report_validation_metrics(step, {"val_loss": 1.0 / step})
            with ctx.checkpoint.store_path({"steps_completed": step}) as (path, _):
                (path / "state.json").write_text(json.dumps({"step": step}))
            (ctx.outputs_dir / f"render-{step}.txt").write_text("a render")
        if step == stop_at:
            break
"""

CONFIG = {
    "name": "shared", "entrypoint": "python3 train.py",
    "searcher": {"name": "single", "metric": "val_loss", "smaller_is_better": True},
    "hyperparameters": {}, "max_restarts": 0,
    "data": {"det_lab": {"project": "vla", "dataset": "tiny-data", "max_length": {"batches": 40}}},
}


@dataclass
class User:
    name: str
    uid: int
    gid: int  # personal primary group
    home: Path


@dataclass
class Team:
    base: Path
    group: str
    gid: int
    a: User
    b: User
    bin: Path  # a venv's bin/ the users can run

    @property
    def data(self) -> Path:
        return self.base / "data"

    def start(self, user: User, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``det-lab ARGS`` as ``user`` with umask 022, as a shell login would run it."""
        run_env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": str(user.home), "USER": user.name,
                   "LOGNAME": user.name, "DET_LAB_CONFIG": str(self.base / "lab.yaml"), "COLUMNS": "200",
                   **(env or {})}
        return subprocess.Popen([str(self.bin / "det-lab"), *args], user=user.uid, group=user.gid,
                                extra_groups=[self.gid], umask=0o022, env=run_env, cwd=user.home,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def det_lab(self, user: User, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``det-lab ARGS`` as ``user``, to its end."""
        return finish(self.start(user, *args, env=env))


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    """Wait for a started det-lab (killed past 300 s) and return what it printed."""
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _add_user(name: str, group: str, base: Path) -> User:
    subprocess.run(["useradd", "--no-create-home", "--user-group", "--groups", group, "--shell", "/bin/sh", name],
                   check=True, capture_output=True)
    pw = pwd.getpwnam(name)
    home = base / f"home-{name}"
    home.mkdir(mode=0o700)
    # no safe.directory: det_lab's git commands trust the dataset repositories they are asked to
    # read, which the first member owns
    (home / ".gitconfig").write_text(f"[user]\n\tname = {name}\n")
    for p in (home, home / ".gitconfig"):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    return User(name, pw.pw_uid, pw.pw_gid, home)


def _venv_for(user: User, base: Path) -> Path:
    """A venv the users can run: the test venv's packages on an interpreter they can reach (the
    test interpreter may lie under a directory only root enters, like /root/.pyenv)."""
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for python in (os.path.realpath(sys.executable), f"/usr/bin/{minor}", f"/usr/local/bin/{minor}"):
        try:
            if subprocess.run([python, "-c", "pass"], user=user.uid, capture_output=True).returncode == 0:
                break
        except OSError:  # missing, or in a directory the user cannot enter
            continue
    else:
        pytest.skip(f"no {minor} interpreter that an unprivileged user may run")
    venv = base / "venv"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "test_venv.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    probe = subprocess.run([venv / "bin/python", "-c", "import det_lab.cli.app"], user=user.uid, capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"det_lab cannot be imported by another user here (a checkout under /root?): {probe.stderr[-200:]!r}")
    script = venv / "bin/det-lab"
    script.write_text(f"#!{venv}/bin/python\nfrom det_lab.cli.app import main\nmain()\n")
    script.chmod(0o755)
    return venv / "bin"


@pytest.fixture
def team():
    tag = uuid.uuid4().hex[:6]
    group, names = f"dlteam{tag}", (f"dla{tag}", f"dlb{tag}")
    base = Path(tempfile.mkdtemp(prefix="det-lab-shared-"))
    base.chmod(0o755)
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    users: list[User] = []
    try:
        users = [_add_user(n, group, base) for n in names]
        gid = grp.getgrnam(group).gr_gid
        # what an admin prepares: the mount point, owned by the team's group
        (base / "data").mkdir()
        os.chown(base / "data", 0, gid)
        (base / "data").chmod(0o2775)
        # one MLflow store for the team, beside the volume
        (base / "mlflow").mkdir()
        os.chown(base / "mlflow", 0, gid)
        (base / "mlflow").chmod(0o2775)
        tracking = {"backend": "mlflow", "mlflow_uri": f"sqlite:///{base}/mlflow/mlflow.db"}
        (base / "lab.yaml").write_text(yaml.safe_dump({"data_root": str(base / "data"), "group": group,
                                                       "tracking": tracking}))
        trial = base / "trial"
        trial.mkdir()
        (trial / "train.py").write_text(TRIAL)
        (trial / "const.yaml").write_text(yaml.safe_dump(CONFIG))
        trial.chmod(0o755)
        yield Team(base, group, gid, *users, bin=_venv_for(users[0], base))
    finally:
        for u in users:
            subprocess.run(["userdel", u.name], capture_output=True)
        subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _not_shared(root: Path, team: Team) -> list[str]:
    """Everything under ``root`` another member of the team could not modify or delete."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for p in [Path(dirpath)] + [Path(dirpath) / f for f in filenames]:
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                shared = mode & 0o2070 == 0o2070  # members create and delete entries; setgid keeps the group
            else:  # writable by the group, unless immutable for everyone (DVC cache objects: 0444)
                shared = mode & 0o040 and (mode & 0o020 or not mode & 0o200)
            if not shared or st.st_gid != team.gid:
                bad.append(f"{p.relative_to(team.base)} {mode:o} group {st.st_gid}")
    return bad


def _publish_tiny_dataset(team: Team) -> None:
    """The admin (root) publishes a small dataset the trial pulls (git + DVC, written by DVC)."""
    src = team.base / "tiny-src"
    src.mkdir()
    rows = [f"{x / 100:.2f},{3 * x / 100 + 0.5:.3f}\n" for x in range(-100, 100)]
    (src / "train.csv").write_text("".join(rows[::2]))
    (src / "val.csv").write_text("".join(rows[1::2]))
    publish_directory(load_settings(team.base / "lab.yaml", env={}), "vla", "tiny-data", src, "tiny")


def test_one_member_resumes_and_deletes_what_another_wrote(team):
    init = team.det_lab(team.a, "init")
    assert init.returncode == 0, init.stderr
    _publish_tiny_dataset(team)
    first = team.det_lab(team.a, "run", str(team.base / "trial"), "--local", env={"STOP_AT": "20"})
    assert first.returncode == 0, first.stdout + first.stderr
    (run_dir,) = list((team.data / "outputs/vla/local-runs").iterdir())
    ckpts = team.data / "checkpoints/vla"
    assert {p.stat().st_uid for p in ckpts.iterdir()} == {team.a.uid}
    assert (run_dir / "tracking-journal").is_dir()
    assert list((team.data / "dvc-cache/vla").rglob("*.dir")), "the run pulled no dataset"
    # everything a's run wrote on the volume is the team's to change: run directory (journal
    # included), checkpoints, outputs, the shared DVC cache, the locks, the snapshots' parent
    # directory (a snapshot itself is read-only by design). Not the SQLite MLflow store: SQLite
    # creates its file 0644 whatever the umask (a team shares an MLflow server instead)
    written = [run_dir, ckpts, team.data / "outputs/vla", team.data / "dvc-cache/vla", team.data / ".det-lab"]
    assert [bad for d in written for bad in _not_shared(d, team)] == []
    snapshots = team.data / "snapshots/vla"
    assert stat.S_IMODE(snapshots.stat().st_mode) & 0o2070 == 0o2070
    assert {p.lstat().st_gid for p in snapshots.rglob("*")} == {team.gid}

    # b resumes a's run while a trains a PyTorchTrial, whose checkpoints carry a copy of the code,
    # which Determined makes 0755
    tiny = team.start(team.a, "run", str(TINY_PYTORCH_TRIAL), "--local")
    resumed = team.det_lab(team.b, "run", str(team.base / "trial"), "--local", "--resume", "--run", run_dir.name)
    tiny = finish(tiny)
    assert tiny.returncode == 0, tiny.stdout + tiny.stderr
    codes = list(ckpts.glob("*/code"))
    assert codes and [bad for c in codes for bad in _not_shared(c, team)] == []

    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    state = yaml.safe_load((run_dir / "run.json").read_text())
    assert state["status"] == "finished" and state["latest_checkpoint_step"] == 40
    # b's trial applied retention (Determined's defaults: the best and the latest) to a's checkpoints too
    assert len(state["checkpoints"]) + len(state.get("checkpoints_deleted", [])) == 4
    assert {p.stat().st_uid for p in ckpts.iterdir()} == {team.a.uid, team.b.uid}

    # b cleans up a's runs: the run directories, every checkpoint (a's and b's), the dataset cache
    cache = team.data / "dvc-cache/vla"
    runs = team.data / "outputs/vla/local-runs"
    rm = subprocess.run(["rm", "-rf", *map(str, runs.iterdir()), *map(str, ckpts.iterdir()), *map(str, cache.iterdir())],
                        user=team.b.uid,
                        group=team.b.gid, extra_groups=[team.gid], capture_output=True, text=True)
    assert rm.returncode == 0, rm.stderr
    assert list(runs.iterdir()) == [] and list(ckpts.iterdir()) == [] and list(cache.iterdir()) == []


def test_a_snapshot_another_member_downloaded_unreadable_is_one_line_and_imports_once_readable(team):
    """safetensors writes its files 0600: b importing the snapshot a downloaded is told which file and
    what to do, in one line, with nothing written to the store; once a makes it readable it imports."""
    from tests.test_models_store import write_download

    init = team.det_lab(team.a, "init")
    assert init.returncode == 0, init.stderr
    download = write_download(team.base / "a-download")
    for p in [download, *download.rglob("*")]:
        os.chown(p, team.a.uid, team.a.gid)
    assert stat.S_IMODE((download / "model.safetensors").stat().st_mode) == 0o600  # as safetensors leaves it
    refused = team.det_lab(team.b, "models", "import", str(download), "org/tiny")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "model.safetensors: not readable by you" in lines[0] and f"chmod -R a+rX {download}" in lines[0]
    assert not list((team.data / "models").rglob("org*"))
    subprocess.run(["runuser", "-u", team.a.name, "--", "chmod", "-R", "a+rX", str(download)], check=True)
    done = team.det_lab(team.b, "models", "import", str(download), "org/tiny")
    assert done.returncode == 0, done.stderr
    assert (team.data / "models").exists() and list((team.data / "models").rglob("model.safetensors"))
