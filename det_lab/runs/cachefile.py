"""This user's cache files of a volume, on local disk (``$XDG_CACHE_HOME/det-lab``).

A cache file holds plain values only (dicts, lists, tuples, strings, numbers, bytes), pickled:
tens of thousands of small tuples load several times faster than JSON objects, and values
repeated across entries (a dataset's lineage, a storage config) are written once and loaded as
one object. It is never trusted: it starts with a magic, its format version and a BLAKE2b digest
of the rest, and the unpickler refuses every global (no class, no function: nothing a file can
make this process run). A file damaged, cut short, of another format or version, or from an
older det_lab (JSON) loads as ``None``, and the caller rebuilds it from the volume; one of a newer
version (a newer det_lab's, :mod:`det_lab.ondisk`) is not written over: this det_lab works without it.
"""

from __future__ import annotations

import gc
import hashlib
import io
import os
import pickle
from pathlib import Path
from typing import Any

_MAGIC = b"det-lab-cache\n"
_DIGEST = 16


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # noqa: ARG002
        raise pickle.UnpicklingError(f"a cache file names {module}.{name}: refused")


def cache_path(data_root: Path, stem: str) -> Path:
    """This user's cache file ``<stem>-<volume>.pickle`` of the volume at ``data_root``."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "det-lab"
    volume = hashlib.sha256(str(Path(data_root).resolve()).encode()).hexdigest()[:16]
    return base / f"{stem}-{volume}.pickle"


def load(path: Path, version: int) -> Any | None:
    """What :func:`dump` wrote at ``path`` with this ``version``; None for anything else."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = _MAGIC + version.to_bytes(2, "big")
    start = len(head) + _DIGEST
    if not data.startswith(head) or len(data) <= start:
        return None
    body = memoryview(data)[start:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != data[len(head):start]:
        return None
    collecting = gc.isenabled()
    gc.disable()  # tens of thousands of containers made at once, none of them garbage
    try:
        return _PlainUnpickler(io.BytesIO(body)).load()
    except Exception:  # noqa: BLE001 (a digest that matches damaged data: any failure is "no cache")
        return None
    finally:
        if collecting:
            gc.enable()


def dump(path: Path, value: Any, version: int) -> None:
    """Write ``value`` at ``path`` (mode 0600) so that a reader sees the old file or the new one;
    a cache that cannot be written is left as it was."""
    try:
        body = pickle.dumps(value, protocol=5)
    except (pickle.PicklingError, TypeError, RecursionError):
        return
    data = _MAGIC + version.to_bytes(2, "big") + hashlib.blake2b(body, digest_size=_DIGEST).digest() + body
    if written_version(path) > version:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def written_version(path: Path) -> int:
    """The version a cache file at ``path`` says it holds; 0 when there is none (or not a cache file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_MAGIC) + 2)
    except OSError:
        return 0
    return int.from_bytes(head[len(_MAGIC):], "big") if len(head) == len(_MAGIC) + 2 and head.startswith(_MAGIC) else 0


def shared(value: Any, seen: dict[Any, Any]) -> Any:
    """``value``, or an equal one met before (``seen``): equal values saved once, loaded as one."""
    if isinstance(value, dict):
        key: Any = (dict, repr(sorted(value.items(), key=repr)))  # no cached tuple holds a type
    elif isinstance(value, (str, tuple)):
        key = value
    else:
        return value
    try:
        return seen.setdefault(key, value)
    except TypeError:  # a tuple holding a list
        return value
