"""Time dataset pulls side by side: plain DVC against det_lab's first and Nth pull.

    python bench/data_pull.py [--files 2000] [--file-kib 512] [--root DIR]

Makes a dataset of ``--files`` random files, publishes it to a fresh lab volume (a local
directory standing in for NFS), then times, in one run:

  a. plain ``dvc pull`` into a fresh clone with its own cache (what each machine does today);
  b. DVC with a warm shared cache: fresh clone, ``cache.type symlink``, ``dvc pull``;
  c. det_lab's first pull (cold shared cache: fetch + verify + snapshot);
  d. det_lab's Nth pull of the same revision, pinned to a commit and by branch name,
     in-process (what a trial pays) and as a whole ``det-lab data pull`` process; every Nth pull
     includes the integrity check (size and mtime of every file against the snapshot's record),
     which is also timed alone.

For the Nth-pull budget (< 50 ms at 10,000 files): ``--files 10000 --file-kib 4``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from det_lab import data
from det_lab.data.integrity import changed_files, read_marker
from det_lab.data.publish import publish_directory
from det_lab.settings import load_settings
from det_lab.volume import human_bytes, init_volume

DVC = [sys.executable, "-m", "dvc"]



def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(cmd: list[str], cwd: Path | None = None) -> None:
    subprocess.run(cmd, cwd=cwd, env={**os.environ, "DVC_NO_ANALYTICS": "1"}, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--file-kib", type=int, default=512)
    ap.add_argument("--root", type=Path, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="det-lab-bench-", dir=args.root) as tmp_name:
        tmp = Path(tmp_name)
        os.environ["DET_LAB_DATA_ROOT"] = str(tmp / "volume")
        settings = load_settings(env={"DET_LAB_DATA_ROOT": str(tmp / "volume")})
        init_volume(settings)
        src = tmp / "src"
        for i in range(args.files):
            p = src / f"part{i % 20:02d}" / f"frame{i:05d}.bin"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(os.urandom(args.file_kib * 1024))
        total = args.files * args.file_kib * 1024
        print(f"dataset: {args.files} files, {human_bytes(total)}; volume {tmp / 'volume'} (local disk, not NFS)")
        t_publish = timed(lambda: publish_directory(settings, "vla", "bench", src, "bench"))
        spec = data.load_registry(settings)["bench"]
        print(f"publish (dvc add + push + git push): {t_publish:.2f} s")

        # a. plain DVC, own cache per clone (copy links: DVC's default on ext4/NFS)
        plain = tmp / "plain"
        run(["git", "clone", "-q", spec.repo, str(plain)])
        t_plain = timed(lambda: run([*DVC, "pull", "-q"], cwd=plain))

        # c. det_lab first pull: cold shared cache
        first = None

        def first_pull():
            nonlocal first
            first = data.pull(spec, settings, progress=False)

        t_first = timed(first_pull)
        assert first is not None and first.fetched

        # b. DVC with the now-warm shared cache and symlinks (the best plain DVC can do)
        sym = tmp / "symlink"
        run(["git", "clone", "-q", spec.repo, str(sym)])
        (sym / ".dvc" / "config.local").write_text(
            f"[cache]\n    dir = {settings.data_root / 'dvc-cache' / 'vla'}\n    type = symlink\n    shared = group\n"
        )
        t_sym = timed(lambda: run([*DVC, "pull", "-q"], cwd=sym))

        # d. det_lab Nth pull
        pinned = data.DatasetSpec(spec.project, spec.repo, spec.path, rev=first.identity.commit)
        data.pull(pinned, settings)
        nth_pinned = [timed(lambda: data.pull(pinned, settings)) for _ in range(20)]
        snap = first.path.parent
        check = [timed(lambda: changed_files(snap, read_marker(snap))) for _ in range(20)]
        cpu = time.process_time()
        for _ in range(20):
            changed_files(snap, read_marker(snap))
        check_cpu = (time.process_time() - cpu) / 20  # what it costs without other load on the machine
        assert changed_files(snap, read_marker(snap)) == []
        nth_branch = [timed(lambda: data.pull(spec, settings)) for _ in range(20)]
        det_lab = str(Path(sys.executable).with_name("det-lab"))
        nth_cli = [timed(lambda: run([det_lab, "data", "pull", "bench"])) for _ in range(3)]

    rows = [
        ("a. dvc pull, fresh clone, own cache (copy)", t_plain),
        ("b. dvc pull, fresh clone, warm shared cache (symlink)", t_sym),
        ("c. det_lab first pull (cold shared cache, verified snapshot)", t_first),
        ("d. det_lab Nth pull, pinned commit (in-process, median of 20)", statistics.median(nth_pinned)),
        (f"   of which the integrity check of {args.files} files (median of 20)", statistics.median(check)),
        ("   the same check, CPU time of this process (mean of 20)", check_cpu),
        ("d. det_lab Nth pull, branch name (in-process, median of 20)", statistics.median(nth_branch)),
        ("d. det-lab data pull process, Nth (median of 3, incl. Python start)", statistics.median(nth_cli)),
    ]
    print()
    print(f"{'what':<72} {'ms':>10} {'a / this':>9}")
    for what, secs in rows:
        print(f"{what:<72} {secs * 1000:>10.2f} {t_plain / secs:>8.0f}x")


if __name__ == "__main__":
    main()
