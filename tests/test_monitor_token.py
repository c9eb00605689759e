"""``det-lab monitor token`` finding the master in a cluster config it cannot read."""

from __future__ import annotations


def test_token_with_a_damaged_cluster_config_is_one_error_line(lab, tmp_path):
    """No --master and no master_url: the master comes from cluster.yaml; a damaged one (here a key
    written by hand that the schema does not know) is one error naming the file, the token untouched."""
    cluster_file = lab.root / ".det-lab" / "cluster.yaml"
    cluster_file.parent.mkdir(parents=True)
    cluster_file.write_text("cluster_name: lab\nmaster_prot: 8080\n")
    token = tmp_path / "det-master.token"
    token.write_text("old-token")
    lab.env.update(DET_USER="prometheus", DET_PASS="secret")
    proc = lab.cli("monitor", "token", "--out", str(token.parent))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("error:") and str(cluster_file) in lines[0] and "master_prot" in lines[0]
    assert token.read_text() == "old-token"
