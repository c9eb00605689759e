"""The line protocol of the tests' child processes (tests/tiny_smolvla.py, tests/pi_child.py): the
child says one word per stage on stdout and waits for a line on stdin; its stderr goes to a log."""

from __future__ import annotations

import subprocess
from pathlib import Path


def expect(child: subprocess.Popen, word: str, log: Path) -> None:
    """Read the child's next word; fail with its log's tail if it is not ``word``."""
    line = child.stdout.readline().strip()
    assert line == word, f"the child said {line!r}, not {word!r}:\n{log.read_text()[-4000:]}"


def finish(child: subprocess.Popen, last: str, log: Path) -> None:
    """Send the child its last line, then expect ``done`` and a clean exit."""
    child.stdin.write(last + "\n")
    child.stdin.close()
    expect(child, "done", log)
    assert child.wait(timeout=120) == 0, log.read_text()[-3000:]
