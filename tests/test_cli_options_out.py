"""`--out` names a directory in every command: the command writes its named files inside, and a
regular file there (or a new path named like the file, from a script written when `--out` named
it) is one error line with nothing written."""

from __future__ import annotations

import pytest
import yaml

from tests.test_bad_inputs import cli

# (command, the file(s) it writes inside --out)
COMMANDS = [
    (("cluster", "template"), ["det-lab-template.yaml"]),
    (("cluster", "template", "--notebook"), ["det-lab-notebook-template.yaml"]),
    (("cluster", "config"), ["master.yaml"]),
    (("cluster", "backup-timer", "--user", "root"), ["det-lab-backup.service", "det-lab-backup.timer"]),
    (("monitor", "config"), ["prometheus/prometheus.yml"]),
]


@pytest.mark.parametrize(("args", "files"), COMMANDS, ids=[" ".join(a) for a, _ in COMMANDS])
def test_out_is_a_directory_the_named_files_go_into(lab, tmp_path, args, files):
    out = tmp_path / "rendered"
    proc = cli(lab, *args, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in files:
        assert yaml.safe_load((out / name).read_text()) if name.endswith((".yaml", ".yml")) else (out / name).read_text()
    # an existing regular file is refused in one line and left as it was
    taken = tmp_path / "taken"
    taken.write_text("keep me\n")
    proc = cli(lab, *args, "--out", str(taken))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0] == (
        f"error: --out {taken} is a file: --out names a directory, the command writes its files inside")
    assert taken.read_text() == "keep me\n"


def test_out_named_like_the_file_is_refused_before_a_directory_of_that_name_is_made(lab, tmp_path):
    proc = cli(lab, "cluster", "template", "--out", str(tmp_path / "det-lab-template.yaml"))
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: --out {tmp_path / 'det-lab-template.yaml'} looks "
                                                           "like a file name")
    assert f"--out {tmp_path}" in proc.stderr and not (tmp_path / "det-lab-template.yaml").exists()
    proc = cli(lab, "monitor", "token", "--out", str(tmp_path / "det-master.token"), "--master", "http://127.0.0.1:9")
    assert proc.returncode == 2 and "looks like a file name" in proc.stderr
    assert not (tmp_path / "det-master.token").exists()


def test_monitor_configs_token_timer_passes_the_directory_monitor_token_writes_into(lab, tmp_path):
    cfg = lab.root / ".det-lab" / "cluster.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(yaml.safe_dump({"master_host": "det-master", "master_port": 8080}))
    out = tmp_path / "mon"
    proc = cli(lab, "monitor", "config", "--out", str(out), "--machine", "gpu-a")
    assert proc.returncode == 0, proc.stderr
    service = (out / "systemd" / "det-lab-monitor-token.service")
    assert f"monitor token --out {(out / 'prometheus').resolve()}\n" in service.read_text()
