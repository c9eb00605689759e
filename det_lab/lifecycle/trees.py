"""What ``rm -r`` would meet in a run's trees, without listing every directory again.

:class:`TreeCache` keeps, on this user's local disk (``$XDG_CACHE_HOME/det-lab/trees-<volume>.pickle``,
:mod:`~det_lab.runs.cachefile`),
each directory's entries under its inode, modification and change times: an entry is added,
removed or renamed only by changing its directory's mtime, and a chmod, chown or ACL change
changes its ctime, so a directory whose three figures are unchanged has the same entries and the
same permissions. Its listing is then taken from the cache (one ``lstat`` instead of a
``scandir``), and so is whether this user may read, write and search it (``access(2)``'s answer;
the whole cache is dropped when this user's groups differ from those it was made with).

A file can grow without its directory changing, so every file's size is asked again (``lstat``),
except in a complete checkpoint (its ``metadata.json`` there, nothing in it changed for
:data:`SETTLED_S`): a checkpoint is written once and never changed in place (as
:mod:`det_lab.lifecycle.space` also takes it), so its sizes are kept under its directories' figures.
"""

from __future__ import annotations

import getpass
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from det_lab.ondisk import TREES_CACHE
from det_lab.runs import cachefile

#: a complete checkpoint unchanged this long is taken as written for good (its sizes kept)
SETTLED_S = 60.0
#: an entry no plan looked at for this long leaves the cache
FORGET_S = 30 * 86400.0
_RWX = os.R_OK | os.W_OK | os.X_OK
# a directory's cache entry: [ino, mtime_ns, ctime_ns, {file: size}, [dirs], [links], sizes kept,
# may this user read, write and search it (None: not asked), when a plan last looked]
_FILES, _DIRS, _LINKS, _KEPT, _ACCESS, _SEEN, _LEN = 3, 4, 5, 6, 7, 8, 9
# a complete checkpoint of one directory this user may remove: [ino, mtime_ns, ctime_ns, bytes, seen]
_COMPACT = 5
_TREES_VERSION = TREES_CACHE.version  # of the cache file's shape: {identity, dirs: {path: entry}}


@dataclass
class Tree:
    """One tree as ``rm -r`` would meet it (see :func:`cannot_remove`)."""

    exists: bool
    bytes: int = 0  # the apparent sizes of the files below (a link its own; directories nothing)
    refused: str | None = None  # why this user could not ``rm -r`` it
    names: frozenset[str] = frozenset()  # the top directory's entries


def _identity() -> str:
    return f"{os.geteuid()}:{os.getegid()}:{','.join(map(str, sorted(set(os.getgroups()))))}"


class TreeCache:
    """Directory listings, permission answers and checkpoint sizes, kept between plans."""

    def __init__(self, data_root: Path, *, fresh: bool = False) -> None:
        self.path = cachefile.cache_path(data_root, "trees")
        known = cachefile.load(self.path, _TREES_VERSION)
        known = known if isinstance(known, dict) else {}
        self.identity = _identity()
        # what another set of groups could list and was allowed is no answer for this one
        same = not fresh and known.get("identity") == self.identity and isinstance(known.get("dirs"), dict)
        self.known: dict[str, Any] = known["dirs"] if same else {}
        self.now = time.time()
        self.changed = False
        self.parents: dict[str, tuple[str | None, int | None]] = {}  # why not, sticky owner
        self.user = getpass.getuser()
        self.euid = os.geteuid()

    # --- one directory -------------------------------------------------------------------------

    def _listing(self, path: str, st: os.stat_result) -> list | None:
        """The cache's entry of ``path`` (whose ``lstat`` is ``st``), listed again when it
        changed; None when it cannot be listed."""
        hit = self.known.get(path)
        if (isinstance(hit, list) and len(hit) == _LEN
                and (hit[0], hit[1], hit[2]) == (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)):
            hit[_SEEN] = self.now
            return hit
        files: dict[str, int] = {}
        dirs: list[str] = []
        links: list[str] = []
        try:
            with os.scandir(path) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        dirs.append(e.name)
                    elif e.is_symlink():
                        links.append(e.name)
                    else:
                        files[e.name] = 0
        except OSError:
            return None
        entry = [st.st_ino, st.st_mtime_ns, st.st_ctime_ns, files, dirs, links, False, None, self.now]
        self.known[path] = entry
        self.changed = True
        return entry

    def _may_rwx(self, path: str, entry: list) -> bool:
        if entry[_ACCESS] is None:
            entry[_ACCESS] = os.access(path, _RWX)
            self.changed = True
        return bool(entry[_ACCESS])

    def parent_refuses(self, tree: str, tree_uid: int) -> str | None:
        """Why the directory holding ``tree`` does not let this user remove it (write and search
        rights; a sticky one needs the owner), asked once per directory and plan."""
        parent = tree.rpartition("/")[0] or "/"
        if parent not in self.parents:
            if not os.access(parent, os.W_OK | os.X_OK):
                self.parents[parent] = (f"{parent} is not writable by {self.user}", None)
            else:
                pst = os.stat(parent)
                self.parents[parent] = (None, pst.st_uid if pst.st_mode & stat.S_ISVTX else None)
        why, sticky_owner = self.parents[parent]
        if why is None and sticky_owner is not None and self.euid not in (0, sticky_owner, tree_uid):
            return f"{parent} is sticky and {os.path.basename(tree)} is not {self.user}'s"
        return why

    # --- one tree ------------------------------------------------------------------------------

    def tree(self, top: str, checkpoint: bool = False) -> Tree:
        """``top`` as ``rm -r`` would meet it: its sizes, whether this user may remove it, its
        entries. ``checkpoint``: the sizes of a complete, settled checkpoint are kept."""
        try:
            st = os.lstat(top)
        except FileNotFoundError:
            return Tree(False)
        refused = self.parent_refuses(top, st.st_uid)
        hit = self.known.get(top)
        if isinstance(hit, list) and len(hit) == _COMPACT:  # the common checkpoint: one directory, kept
            if checkpoint and (hit[0], hit[1], hit[2]) == (st.st_ino, st.st_mtime_ns, st.st_ctime_ns):
                hit[4] = self.now
                return Tree(True, hit[3], refused)
            del self.known[top]
        if not stat.S_ISDIR(st.st_mode):  # a file or a link: rm removes it as such
            linked = stat.S_ISLNK(st.st_mode) and os.path.isdir(top)
            return Tree(True, walked_bytes(top) if linked else 0, refused)
        total, unreadable, names = 0, None, frozenset()
        seen: list[list] = []
        settled = checkpoint
        old = self.now - SETTLED_S
        stack: list[tuple[str, os.stat_result | None]] = [(top, st)]
        while stack:  # os.walk's order: a directory, then each subdirectory's tree in turn
            path, dst = stack.pop()
            if dst is None:
                try:
                    dst = os.lstat(path)
                except OSError:
                    continue
            entry = self._listing(path, dst)
            if entry is None:
                unreadable = unreadable or path
                continue
            if refused is None and not self._may_rwx(path, entry):
                refused = f"{path} is not writable by {self.user} (the group needs write rights)"
            if path == top:
                names = frozenset([*entry[_FILES], *entry[_DIRS], *entry[_LINKS]])
            seen.append(entry)
            settled = settled and max(dst.st_mtime, dst.st_ctime) < old
            files: dict[str, int] = entry[_FILES]
            if not entry[_KEPT]:  # a file grows without its directory changing: ask each
                prefix = path + os.sep
                for name in files:
                    try:
                        fst = os.lstat(prefix + name)
                    except OSError:
                        files[name], settled = 0, False
                        continue
                    files[name] = fst.st_size
                    settled = settled and max(fst.st_mtime, fst.st_ctime) < old
            total += sum(files.values())
            for name in entry[_LINKS]:
                link = os.path.join(path, name)
                if not os.path.isdir(link):  # os.walk takes a link to a directory for a directory
                    try:
                        total += os.lstat(link).st_size
                    except OSError:
                        pass
            stack.extend((os.path.join(path, d), None) for d in reversed(entry[_DIRS]))
        if refused is None and unreadable is not None:
            refused = f"{unreadable} cannot be read by {self.user}"
        if settled and "metadata.json" in names:
            if len(seen) == 1 and not seen[0][_DIRS] and not seen[0][_LINKS] and seen[0][_ACCESS] is True:
                e = seen[0]
                self.known[top] = [e[0], e[1], e[2], sum(e[_FILES].values()), self.now]
                self.changed = True
            for entry in seen:
                if not entry[_KEPT]:
                    entry[_KEPT], self.changed = True, True
        return Tree(True, total, refused, names)

    def save(self) -> None:
        """Write what this plan learnt (entries unseen for :data:`FORGET_S` are dropped)."""
        if not self.changed:
            return
        keep = {p: e for p, e in self.known.items() if isinstance(e, list) and len(e) in (_LEN, _COMPACT)
                and e[-1] > self.now - FORGET_S}
        cachefile.dump(self.path, {"identity": self.identity, "dirs": keep}, _TREES_VERSION)


def cannot_remove(tree: Path) -> str | None:
    """Why this user could not ``rm -r tree`` (Unix permissions, as rm would meet them), or None:
    the plan from scratch (:class:`TreeCache` gives the same answer from its cache)."""
    parent = tree.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable by {getpass.getuser()}"
    pst = parent.stat()
    if pst.st_mode & stat.S_ISVTX and os.geteuid() not in (0, pst.st_uid, tree.lstat().st_uid):
        return f"{parent} is sticky and {tree.name} is not {getpass.getuser()}'s"
    if not tree.is_dir() or tree.is_symlink():
        return None
    unreadable: list[OSError] = []
    for dirpath, _, _ in os.walk(tree, onerror=unreadable.append):  # os.walk does not follow links
        if not os.access(dirpath, _RWX):
            return f"{dirpath} is not writable by {getpass.getuser()} (the group needs write rights)"
    if unreadable:
        return f"{unreadable[0].filename} cannot be read by {getpass.getuser()}"
    return None


def walked_bytes(top: str | Path) -> int:
    """The sizes of the files ``os.walk(top)`` lists (a link to a directory given as ``top`` is
    walked: what :func:`cannot_remove`'s plan has always counted)."""
    total = 0
    for dirpath, _, files in os.walk(top):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                continue
    return total
