"""Every command block in the guides (docs/ and README.md) that can run here runs, on a demo lab.

A ```bash, ```console or ```sh block runs line by line (``$ `` lines of a console block); each
command must exit 0. A block that cannot run here says so with a comment on the line before it:
``<!-- needs: cluster -->`` (a Slurm or Determined cluster, Docker, root on a server, a name to
fill in) or ``<!-- needs: time -->`` (an install or a training run: minutes). Those are counted and
skipped, so a new command block is either run or marked: it cannot rot unseen. The reference pages
(docs/reference/) are generated from the code and checked by tests/test_docs_reference.py.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import VENV_BIN, Lab

REPO = Path(__file__).resolve().parents[1]
NEEDS = {"cluster", "time"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*needs:\s*(?P<need>[\w-]+)\s*-->\s*$")
SHELLS = {"bash", "console", "sh", "shell"}


@dataclass(frozen=True)
class Block:
    """One fenced command block of a guide."""

    file: str
    line: int  # of its opening fence, 1-based
    lang: str
    text: str
    need: str | None  # from a <!-- needs: ... --> comment on the line before it

    @property
    def commands(self) -> list[str]:
        """The commands it holds: comments and console output left out, continuation lines joined."""
        out: list[str] = []
        pending = ""
        for raw in self.text.splitlines():
            line = raw.strip()
            if self.lang == "console" and not pending:  # a continuation line has no prompt
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            pending += line
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip() + " "
                continue
            out.append(pending)
            pending = ""
        return out


def guides() -> list[Path]:
    """The hand-written pages: README.md and docs/ less the generated reference."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [p for p in pages if "reference" not in p.relative_to(REPO).parts]


def blocks(path: Path) -> list[Block]:
    """Every shell block of ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group("lang"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if m.group("lang") in SHELLS:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = _MARK.match(before)
            text = "\n".join(line.removeprefix(m.group("indent")) for line in lines[i + 1:end])
            found.append(Block(str(path.relative_to(REPO)), i + 1, m.group("lang"), text,
                               mark.group("need") if mark else None))
        i = end + 1
    return found


ALL = [b for page in guides() for b in blocks(page)]
RUNNABLE = [b for b in ALL if b.need is None]


def test_the_guides_have_command_blocks_and_every_mark_is_known():
    assert len(ALL) >= 30 and len(RUNNABLE) >= 15, (len(ALL), len(RUNNABLE))
    unknown = [f"{b.file}:{b.line} needs {b.need}" for b in ALL if b.need is not None and b.need not in NEEDS]
    assert not unknown, f"a mark names one of {sorted(NEEDS)}: {unknown}"
    assert all(b.commands for b in ALL), [f"{b.file}:{b.line}" for b in ALL if not b.commands]


@pytest.mark.parametrize("need", sorted(NEEDS))
def test_blocks_that_cannot_run_here_are_counted(need):
    marked = [f"{b.file}:{b.line}" for b in ALL if b.need == need]
    pytest.skip(f"{len(marked)} command blocks need {need}: {', '.join(marked)}")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Lab:
    """A lab after ``det-lab init --demo``, with no tracker server: the quick start's lab."""
    tmp = tmp_path_factory.mktemp("docs-demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DET_LAB_", "MLFLOW_", "DET_MASTER"))}
    env.update(DET_LAB_CONFIG=str(tmp / "lab.yaml"), XDG_CONFIG_HOME=str(tmp / "xdg-config"),
               XDG_CACHE_HOME=str(tmp / "xdg-cache"), HOME=str(tmp / "home"), COLUMNS="160",
               PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    (tmp / "home").mkdir()
    lab = Lab(root=tmp / "data", config=tmp / "lab.yaml", env=env)
    lab.write_config(tracking={"backend": "none"})
    lab.cli("init", "--demo", check=True)
    env["DET_LAB_DATA_ROOT"] = str(lab.root)  # as the quick start sets it
    return lab


@pytest.fixture
def workdir(tmp_path) -> Path:
    """Where a block runs: a scratch directory (what it renders lands there) that sees the
    checkout's templates and notebooks at the paths the guides name."""
    for name in ("experiment_templates", "notebooks", "cluster"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{b.file}:{b.line}" for b in RUNNABLE])
def test_command_block_runs_on_the_demo_lab(demo, workdir, block):
    for command in block.commands:
        proc = subprocess.run(["bash", "-c", command], env=demo.env, cwd=workdir, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, (
            f"{block.file}:{block.line}: `{command}` exited {proc.returncode} (mark the block "
            f"<!-- needs: cluster --> or <!-- needs: time --> if it cannot run here)\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-2000:]}")


def test_a_failing_command_is_caught(demo):
    """The runner sees a command that fails (not just the last of a pipeline or block)."""
    bad = Block("x.md", 1, "bash", "det-lab --version\ndet-lab data pull no-such-dataset\n", None)
    codes = [subprocess.run(["bash", "-c", c], env=demo.env, cwd=REPO, capture_output=True).returncode
             for c in bad.commands]
    assert codes[0] == 0 and codes[1] != 0
    assert Block("x.md", 1, "console", "$ det-lab a \\\n  --b\noutput\n$ det-lab c # note\n", None).commands == [
        "det-lab a --b", "det-lab c # note"]


# --- the front page ------------------------------------------------------------------------

_LINK = re.compile(r"\]\((?P<target>[^)#\s]+\.md)(?:#(?P<anchor>[^)\s]+))?\)")


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs (and GitHub) give the headings of ``page``."""
    ids = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = re.sub(r"[`*]", "", line.lstrip("#").strip()).lower()
            ids.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title)).strip("-"))
    return ids


def test_the_front_page_is_short_and_each_link_resolves():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 200, "README.md is the front page: move sections into docs/"
    assert "bash tests/setup.sh && python -m pytest" in readme  # .ci/run greps for it
    broken = []
    for m in _LINK.finditer(readme):
        page = REPO / m.group("target")
        if not page.is_file() or (m.group("anchor") and m.group("anchor") not in _anchors(page)):
            broken.append(m.group(0))
    assert not broken, broken
    # a newcomer reaches the two tasks the issue names in one click from here
    assert "docs/researchers/slurm.md#train-on-your-own-lerobot-dataset" in readme
    assert "docs/admin/accounting.md#add-a-member-with-a-gpu-limit" in readme
