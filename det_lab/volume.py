"""The shared data volume: its layout, its creation, and how much each project uses.

One NFS volume, mounted at the same path on every machine (``/mnt/data`` by default)::

    <root>/
      datasets/<project>/      DVC remotes, one per project
      dvc-cache/<project>/     the shared DVC cache (per project, so quotas can be counted)
      snapshots/<project>/     read-only, verified dataset revisions that trials reuse
      checkpoints/             Determined shared_fs checkpoint storage
      checkpoints/<project>/   ... the part experiment templates of a project write to
      outputs/<project>/       anything else a run writes (renders, logs, exported policies)
      .det-lab/locks/          cross-machine lock files
      .det-lab/volume.json     marks an initialised volume

Directories are group-shared: setgid and group-writable, so files made by any team member stay
in the volume's group and every member can write beside them.
"""

from __future__ import annotations

import datetime as dt
import getpass
import grp
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_lab.errors import UserError

if TYPE_CHECKING:
    from det_lab.settings import LabSettings

LAYOUT_VERSION = 1
SHARED_DIR_MODE = 0o2775  # rwxrwsr-x


@dataclass(frozen=True)
class VolumeLayout:
    """Paths on the shared volume. Pure path arithmetic: touches nothing on disk."""

    root: Path

    @classmethod
    def from_settings(cls, settings: LabSettings) -> VolumeLayout:
        return cls(settings.data_root)

    def datasets(self, project: str) -> Path:
        return self.root / "datasets" / project

    def dvc_cache(self, project: str) -> Path:
        return self.root / "dvc-cache" / project

    def snapshots(self, project: str) -> Path:
        return self.root / "snapshots" / project

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def project_checkpoints(self, project: str) -> Path:
        return self.checkpoints / project

    def experiment_checkpoints(self, project: str, exp_conf: dict[str, Any] | None = None) -> Path:
        """Where an experiment's checkpoints go, in local runs as on the cluster.

        On the cluster that is the master's ``shared_fs`` ``host_path`` (the data root) joined with
        the experiment's ``checkpoint_storage.storage_path``; the templates set it to
        ``checkpoints/<project>``, which is also the default here.
        """
        storage = (exp_conf or {}).get("checkpoint_storage") or {}
        sub = storage.get("storage_path") if storage.get("type", "shared_fs") == "shared_fs" else None
        if not sub:
            return self.project_checkpoints(project)
        path = Path(sub)
        return path if path.is_absolute() else self.root / path

    def outputs(self, project: str) -> Path:
        return self.root / "outputs" / project

    @property
    def state(self) -> Path:
        return self.root / ".det-lab"

    @property
    def locks(self) -> Path:
        return self.state / "locks"

    @property
    def marker(self) -> Path:
        return self.state / "volume.json"

    def project_dirs(self, project: str) -> list[Path]:
        """Every directory whose contents count against ``project``'s quota."""
        return [
            self.datasets(project),
            self.dvc_cache(project),
            self.snapshots(project),
            self.project_checkpoints(project),
            self.outputs(project),
        ]

    def directories(self, projects: list[str]) -> list[Path]:
        """Every directory ``det-lab init`` creates, parents first."""
        top = [self.root / n for n in ("datasets", "dvc-cache", "snapshots", "checkpoints", "outputs")]
        per_project = [d for p in projects for d in self.project_dirs(p)]
        return [self.root, *top, self.state, self.locks, *per_project]


@dataclass
class InitReport:
    """What ``init_volume`` did; nothing in it was ever deleted or overwritten."""

    created: list[Path] = field(default_factory=list)
    existing: list[Path] = field(default_factory=list)
    fixed_permissions: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def init_volume(settings: LabSettings) -> InitReport:
    """Create the volume layout. Idempotent and safe on a populated volume.

    Missing directories are created group-shared; existing ones are kept, and their permissions
    are only widened (setgid, group write) when we own them. Files are never touched.
    """
    layout = VolumeLayout.from_settings(settings)
    gid = _group_id(settings.group)
    report = InitReport()
    for d in layout.directories(sorted(settings.projects)):
        try:  # mkdir first: another machine may make it between a look and a mkdir
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise FileExistsError(f"{d} exists and is not a directory; move it away and re-run") from None
            report.existing.append(d)
            _widen_permissions(d, gid, report)
            continue
        if gid is not None:
            os.chown(d, -1, gid)
        os.chmod(d, SHARED_DIR_MODE)  # explicit: mkdir's mode is cut by the umask
        report.created.append(d)
    _write_marker(layout.marker, settings)
    return report


def share_with_group() -> int:
    """Make everything this process (and its children) creates from now on group-writable.

    Clears the group bits of the umask and keeps the rest: with the usual 022, directories come
    out 0775 and files 0664, so another member of the volume's group can resume, clean up or
    delete what this user wrote. Directories get setgid (and the group) from their parents, which
    ``init_volume`` makes setgid. Files created with an explicit private mode (secrets: 0600)
    stay private. Returns the previous umask.
    """
    old = os.umask(0o022)
    os.umask(old & ~0o070)
    return old


def share_tree(root: Path) -> None:
    """Give the group what the owner has under ``root``, which this user just wrote: for trees
    copied with their source's modes (``shutil.copytree``), where the umask does not apply.
    Directories also get setgid, so the volume's group stays on what is created in them."""
    for dirpath, _dirs, files in os.walk(root):
        for path in (dirpath, *(os.path.join(dirpath, f) for f in files)):
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            shared = mode | (mode & 0o700) >> 3 | (stat.S_ISGID if stat.S_ISDIR(st.st_mode) else 0)
            if shared != mode:
                os.chmod(path, shared)


def is_initialised(layout: VolumeLayout) -> bool:
    return layout.marker.is_file()


def _group_id(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        from det_lab.settings import LabConfigError

        raise LabConfigError(f"group {group!r} (lab config key 'group') does not exist on this machine") from None


def _widen_permissions(d: Path, gid: int | None, report: InitReport) -> None:
    st = d.stat()
    wanted = stat.S_IMODE(st.st_mode) | SHARED_DIR_MODE
    if stat.S_IMODE(st.st_mode) == wanted and (gid is None or st.st_gid == gid):
        return
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        report.warnings.append(
            f"{d}: owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}; "
            f"ask its owner to run: chmod g+ws {d}"
        )
        return
    try:
        if gid is not None and st.st_gid != gid:
            os.chown(d, -1, gid)
        os.chmod(d, wanted)
        report.fixed_permissions.append(d)
    except OSError as exc:  # e.g. root_squash on NFS
        report.warnings.append(f"{d}: could not set group permissions ({exc.strerror})")


def _write_marker(marker: Path, settings: LabSettings) -> None:
    if marker.exists():
        return
    info = {
        "layout_version": LAYOUT_VERSION,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "created_by": getpass.getuser(),
        "projects": sorted(settings.projects),
    }
    atomic_write_text(marker, json.dumps(info, indent=2) + "\n")


def write_synced(path: Path, text: str, mode: int = 0o664) -> None:
    """Write ``text`` to ``path``, on disk (fsync) and with ``mode``, before anything renames it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(path, mode)


def atomic_write_text(path: Path, text: str, mode: int = 0o664) -> None:
    """Write ``path`` so that a reader sees the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_synced(tmp, text, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def disk_usage(*paths: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes allocated under ``paths`` (like ``du -sc``), counting hard-linked files once.

    Symlinks are not followed, and a snapshot hard-linked into the cache counts once. ``seen``
    (inodes already counted, extended here) lets several calls count a file once between them.
    """
    seen = set() if seen is None else seen
    total = 0
    stack = list(paths)
    while stack:
        current = stack.pop()
        try:
            entries = os.scandir(current)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                if st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                total += st.st_blocks * 512
    return total


def project_usage(layout: VolumeLayout, project: str) -> int:
    """Bytes ``project`` uses on the volume, the figure its quota is checked against."""
    return disk_usage(*layout.project_dirs(project))


class QuotaExceeded(UserError, RuntimeError):
    """Raised before writing when a project would go over its quota."""


def check_quota(settings: LabSettings, project: str, incoming: int = 0) -> int:
    """Raise :class:`QuotaExceeded` if ``incoming`` more bytes would put ``project`` over quota.

    Returns the bytes left after the write.
    """
    quota = int(settings.project(project).quota)
    used = project_usage(VolumeLayout.from_settings(settings), project)
    left = quota - used - incoming
    if left < 0:
        raise QuotaExceeded(
            f"project {project!r} would use {human_bytes(used + incoming)} of its "
            f"{human_bytes(quota)} quota ({human_bytes(used)} used, {human_bytes(incoming)} more "
            f"needed); free space under {settings.data_root} or raise projects.{project}.quota"
        )
    return left


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
