"""Collecting what nothing uses: snapshots unused for days, and shared-cache objects no revision needs.

Two steps, per project (each project has its own cache, ``dvc-cache/<project>``):

1. **Snapshots** whose last use (:mod:`det_lab.data.lastuse`) is older than ``days`` are evicted,
   unless a running trial reads them. Their files are hard links into the cache, so the objects
   stay; the next pull of the revision links the snapshot again, without the remote.
2. **Cache objects** that nothing references are removed. The references are gathered across
   every dataset repository that shares the cache: the branch tips and tags of every repository
   that is registered, recorded in a run's lineage, pinned or snapshotted (what ``dvc gc -w -a -T
   --projects <all of them>`` keeps, collected with DVC's own ``Repo.used_objs`` at each commit),
   plus the exact revisions recorded in run lineage (passed in by the layer that reads runs),
   pins, and the snapshots that stay. ``dvc gc`` run in one repository would delete the objects
   only the others use.

What a commit references never changes, so each commit's objects are kept on the volume
(``.det-lab/dvc-used/``) and later runs ask DVC only about new commits. A project whose
references cannot all be read (a repository gone, a manifest missing) is left alone, with the
reason. Objects written in the last hour are never removed (a pull under way may not have
published its snapshot yet), nor objects still linked elsewhere. Every step is a rename or an
unlink, so a collection killed at any point leaves nothing half-removed that a rerun would not
finish; the DVC remote is never touched: anything collected can be pulled again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from det_lab.data.errors import DataError
from det_lab.data.git import clone_at, git
from det_lab.data.integrity import read_marker
from det_lab.data.lastuse import last_use, last_use_file
from det_lab.data.lock import LockTimeout, VolumeLock
from det_lab.data.pins import load_pins
from det_lab.data.pull import SNAPSHOT_MARKER, _configure_workspace, _force_rmtree, cache_object
from det_lab.data.registry import load_registry
from det_lab.errors import UserError
from det_lab.settings import LabSettings, env_value
from det_lab.volume import VolumeLayout, atomic_write_text

GRACE_S = 3600.0  # DET_LAB_GC_GRACE overrides it
EVICTING = ".evict-"
USED_DIR = "dvc-used"


class GcError(UserError):
    """``det-lab data gc`` cannot run: bad input, or another collection holds the volume."""


@dataclass(frozen=True)
class Keep:
    """What the layers that read runs say must stay, per project."""

    #: project -> DVC hashes (``md5``) of the dataset revisions that runs' lineage records
    lineage: dict[str, set[str]] = field(default_factory=dict)
    #: project -> dataset repositories that runs' lineage names
    repositories: dict[str, set[str]] = field(default_factory=dict)
    #: project -> snapshots (their directory names) a running trial reads
    in_use: dict[str, set[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Eviction:
    """A snapshot to evict: unused since ``last_used`` (Unix time)."""

    path: Path
    last_used: float


@dataclass
class ProjectGc:
    """What a collection does, or would do, in one project."""

    project: str
    evict: list[Eviction] = field(default_factory=list)
    remove: list[Path] = field(default_factory=list)  # cache objects
    inodes: dict[Path, int] = field(default_factory=dict)  # each one's inode when the plan was made
    leftovers: list[Path] = field(default_factory=list)  # ``.evict-*`` directories of a killed collection
    kept_objects: int = 0
    freed_bytes: int = 0
    repositories: list[str] = field(default_factory=list)
    skipped: str | None = None  # why nothing of this project's cache is collected


@dataclass
class GcPlan:
    days: float
    projects: list[ProjectGc]

    @property
    def freed_bytes(self) -> int:
        return sum(p.freed_bytes for p in self.projects)


def plan(settings: LabSettings, keep: Keep, days: float, now: float | None = None) -> GcPlan:
    """What ``det-lab data gc --days days`` would evict and remove; changes nothing."""
    if not days >= 0:
        raise GcError(f"--days must be 0 or more (got {days})")
    now = time.time() if now is None else now
    grace = grace_s()
    layout = VolumeLayout.from_settings(settings)
    _require_volume(layout)
    registry, pins = load_registry(settings), load_pins(settings)
    out = []
    for project in sorted(settings.projects):
        repos = {s.repo for s in registry.values() if s.project == project}
        repos |= keep.repositories.get(project, set())
        repos |= {p.repo for p in pins.values() if p.project == project}
        roots = set(keep.lineage.get(project, set())) | {p.md5 for p in pins.values() if p.project == project}
        out.append(_plan_project(layout, project, repos, roots, keep.in_use.get(project, set()), now - days * 86400, now - grace))
    return GcPlan(days, out)


def _require_volume(layout: VolumeLayout) -> None:
    if not layout.state.is_dir():
        raise GcError(f"{layout.state} does not exist: no volume at {layout.root} (run 'det-lab init' there first)")


def grace_s() -> float:
    """Seconds an object written to the cache is safe from collection (``DET_LAB_GC_GRACE``)."""
    return float(env_value("DET_LAB_GC_GRACE", GRACE_S))


def _plan_project(layout: VolumeLayout, project: str, repos: set[str], roots: set[str], in_use: set[str],
                  cutoff: float, written_before: float) -> ProjectGc:
    pg = ProjectGc(project)
    snaps = layout.snapshots(project)
    staying = set()
    for entry in _entries(snaps):
        if entry.name.startswith(EVICTING):
            pg.leftovers.append(Path(entry.path))
            continue
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        marker = read_marker(Path(entry.path))
        if marker is None:
            continue  # being published, or not a snapshot
        repos.add(str(marker.get("identity", {}).get("repo", "")))
        used = _last_used(layout, project, entry.name)
        if entry.name in in_use or used >= cutoff:
            staying.add(str(marker.get("identity", {}).get("md5", "")))
        else:
            pg.evict.append(Eviction(Path(entry.path), used))
    repos.discard("")
    pg.repositories = sorted(repos)
    cache = layout.dvc_cache(project)
    try:
        used_objects = set()
        for repo in sorted(repos):
            used_objects |= tip_objects(layout, cache, repo)
        used_objects = _expand(cache, used_objects | roots | staying)
    except DataError as exc:
        pg.skipped = str(exc)
        pg.freed_bytes = _freed(pg, [])
        return pg
    for oid, path in _objects(cache):
        if oid in used_objects:
            pg.kept_objects += 1
            continue
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_ctime > written_before:
            pg.kept_objects += 1  # written by a pull that may still be publishing it
            continue
        pg.remove.append(path)
        pg.inodes[path] = st.st_ino
    pg.freed_bytes = _freed(pg, pg.remove)
    return pg


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:
        return []


def _last_used(layout: VolumeLayout, project: str, stem: str) -> float:
    """The recorded last use, else when the snapshot was published (its marker's time)."""
    published = os.stat(layout.snapshots(project) / stem / SNAPSHOT_MARKER).st_mtime
    return max(last_use(layout, project, stem) or 0.0, published)


def _objects(cache: Path) -> list[tuple[str, Path]]:
    """``(object id, path)`` of every object in the cache (``<md5>`` or ``<md5>.dir``)."""
    root = cache / "files" / "md5"
    out = []
    for prefix in _entries(root):
        if len(prefix.name) != 2 or not prefix.is_dir():
            continue
        for obj in _entries(Path(prefix.path)):
            name = obj.name
            if len(name.removesuffix(".dir")) == 30 and obj.is_file(follow_symlinks=False):
                out.append((prefix.name + name, Path(obj.path)))
    return out


def _expand(cache: Path, oids: set[str]) -> set[str]:
    """``oids`` with the files of every directory manifest among them (read from the cache)."""
    out = set(oids)
    for oid in oids:
        if not oid.endswith(".dir"):
            continue
        manifest = cache_object(cache, oid)
        try:
            out.update(str(e["md5"]) for e in json.loads(manifest.read_text()))
        except FileNotFoundError:
            raise DataError(f"directory manifest {oid} (a revision that must stay) is not in {cache}: its files "
                            "cannot be told apart, so nothing is collected here; 'det-lab data pull' the revision "
                            "to fetch it again") from None
        except (OSError, ValueError, KeyError, TypeError):
            raise DataError(f"{manifest}: damaged directory manifest: run 'det-lab data verify --repair'") from None
    return out


def _freed(pg: ProjectGc, objects: list[Path]) -> int:
    """Bytes freed by removing ``objects`` and the evicted snapshots: an inode counts only when
    every one of its links goes (a snapshot file is a hard link to its cache object)."""
    links: Counter[tuple[int, int]] = Counter()
    sizes: dict[tuple[int, int], tuple[int, int]] = {}
    dirs = 0
    paths = [*objects]
    for tree in [*(e.path for e in pg.evict), *pg.leftovers]:
        for dirpath, dirnames, filenames in os.walk(tree):
            dirs += os.lstat(dirpath).st_blocks * 512
            paths.extend(Path(dirpath, f) for f in filenames)
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        key = (st.st_dev, st.st_ino)
        links[key] += 1
        sizes[key] = (st.st_nlink, st.st_blocks * 512)
    return dirs + sum(size for key, (nlink, size) in sizes.items() if links[key] >= nlink)


# --- what the repositories' branch tips and tags reference --------------------------------------

def tip_objects(layout: VolumeLayout, cache: Path, repo: str) -> set[str]:
    """Every object the branch tips and tags of ``repo`` reference (``dvc gc -w -a -T``), with
    DVC; each commit's answer is kept on the volume and reused."""
    commits = _tips(repo)
    known = layout.state / USED_DIR / hashlib.sha256(repo.encode()).hexdigest()[:24]
    out: set[str] = set()
    missing = []
    for commit in commits:
        try:
            out.update(json.loads((known / f"{commit}.json").read_text())["objects"])
        except (OSError, ValueError, KeyError, TypeError):
            missing.append(commit)
    if missing:
        for commit, objects in _dvc_used(repo, cache, missing).items():
            out |= objects
            try:
                known.mkdir(parents=True, exist_ok=True)
                atomic_write_text(known / f"{commit}.json", json.dumps({"repo": repo, "objects": sorted(objects)}))
            except OSError:
                pass  # a read-only volume: asked again next time
    return out


def _tips(repo: str) -> list[str]:
    """The commits of ``repo``'s HEAD, branches and tags (annotated tags peeled)."""
    try:
        listing = git("ls-remote", repo, trust=[repo])
    except DataError as exc:
        raise DataError(f"dataset repository {repo} cannot be read ({exc}): nothing is collected from the cache "
                        "it shares, since what it references is unknown; restore it, or unregister the datasets "
                        "that name it") from None
    refs: dict[str, str] = {}
    for line in listing.splitlines():
        sha, _, ref = line.partition("\t")
        if ref == "HEAD" or ref.startswith(("refs/heads/", "refs/tags/")):
            refs[ref.removesuffix("^{}")] = sha  # the peeled line follows its tag: it wins
    return sorted(set(refs.values()))


def _dvc_used(repo: str, cache: Path, commits: list[str]) -> dict[str, set[str]]:
    """The objects each commit references, by DVC's ``Repo.used_objs`` (as ``dvc gc`` collects them)."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    out: dict[str, set[str]] = {}
    with tempfile.TemporaryDirectory(prefix="det-lab-gc-") as tmp:
        ws = Path(tmp) / "ws"
        clone_at(repo, commits[0], ws)
        dvc_commits = [c for c in commits if _has_dvc(ws, c)]
        out.update((c, set()) for c in commits if c not in dvc_commits)  # not a DVC project there: nothing
        if not dvc_commits:
            return out
        git("checkout", "--quiet", "--detach", dvc_commits[0], cwd=ws)
        commits = dvc_commits
        _configure_workspace(ws, cache, Path(tmp) / "site-cache")
        try:
            with Repo(str(ws)) as dvc_repo:
                for commit in dvc_repo.brancher(revs=commits, workspace=False, sha_only=True):
                    objects = {h.value for hashes in dvc_repo.index.used_objs().values() for h in hashes}
                    objects |= {o.hash_info.value for o in dvc_repo.index.outs if o.use_cache and o.hash_info}
                    out[commit] = {o for o in objects if o}
        except DvcException as exc:
            raise DataError(f"DVC cannot read {repo}: {exc}: nothing is collected from the cache it shares") from None
    return out


def _has_dvc(ws: Path, commit: str) -> bool:
    try:
        git("cat-file", "-e", f"{commit}:.dvc", cwd=ws)
        return True
    except DataError:
        return False


# --- doing it ------------------------------------------------------------------------------------

@dataclass
class GcReport:
    evicted: list[Path] = field(default_factory=list)
    removed: int = 0
    kept_back: list[str] = field(default_factory=list)  # evictions and removals given up, with why


def gc_lock(layout: VolumeLayout) -> VolumeLock:
    """One collection at a time on the volume; a killed one's lock is broken by the next."""
    return VolumeLock(layout.locks / "data-gc.lock", timeout=0)


def apply(settings: LabSettings, plan_: GcPlan) -> GcReport:
    """Carry out ``plan_`` (made under :func:`gc_lock`), re-checking each step as it goes."""
    layout = VolumeLayout.from_settings(settings)
    report = GcReport()
    cutoff = time.time() - plan_.days * 86400
    for pg in plan_.projects:
        for leftover in pg.leftovers:
            _force_rmtree(leftover)
        for ev in pg.evict:
            if _evict(layout, pg.project, ev.path, cutoff):
                report.evicted.append(ev.path)
            else:
                report.kept_back.append(f"{ev.path}: used since the plan was made")
        for obj in pg.remove:
            try:
                st = os.lstat(obj)
                # evicting a snapshot dropped its links; one made since (a pull) or a rewritten
                # object (a repair) is not what the plan saw
                if st.st_nlink > 1 or st.st_ino != pg.inodes.get(obj):
                    report.kept_back.append(f"{obj}: linked or written again since the plan was made")
                    continue
                obj.unlink()
                report.removed += 1
            except FileNotFoundError:
                continue
    return report


def _evict(layout: VolumeLayout, project: str, snap: Path, cutoff: float) -> bool:
    """Evict one snapshot: renamed aside (one atomic step: it is whole or gone), then removed.

    A pull records the use before it reads the snapshot's marker; the use is checked again after
    the rename, and a snapshot used in between is put back.
    """
    stem = snap.name
    with VolumeLock(layout.locks / f"{project}-{stem}.lock"):
        if not snap.is_dir() or _last_used(layout, project, stem) >= cutoff:
            return False
        aside = snap.with_name(f"{EVICTING}{stem}-{uuid.uuid4().hex[:8]}")
        os.rename(snap, aside)
        if (last_use(layout, project, stem) or 0.0) >= cutoff:
            os.rename(aside, snap)
            return False
        last_use_file(layout, project, stem).unlink(missing_ok=True)
    _force_rmtree(aside)
    return True


def collect(settings: LabSettings, keep: Keep, days: float, *, yes: bool = False) -> tuple[GcPlan, GcReport | None]:
    """The plan, and with ``yes`` its execution under the volume's gc lock (the plan is made again
    under the lock, so what is deleted is what is shown)."""
    if not yes:
        return plan(settings, keep, days), None
    layout = VolumeLayout.from_settings(settings)
    _require_volume(layout)  # before the lock, which would create .det-lab/locks/
    try:
        with gc_lock(layout):
            made = plan(settings, keep, days)
            return made, apply(settings, made)
    except LockTimeout:
        holder = gc_lock(layout).holder()
        raise GcError(f"another 'det-lab data gc' is running ({holder or 'holder unknown'}); "
                      "wait for it to finish") from None
