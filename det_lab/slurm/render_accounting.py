"""The accounting half of the Slurm configuration: slurm.conf keys, slurmdbd.conf, job_submit.lua.

Rendered only when the Slurm config has an ``accounting:`` section. What it encodes, and why:

- ``AccountingStorageEnforce=associations,limits,qos,safe``: a job runs only under an account its
  user belongs to, and the per-user and per-project GPU limits (QOS ``MaxTRESPerUser``, an
  account's ``GrpTRES``) hold; ``safe`` keeps a job that could outrun its limits from starting;
- ``AccountingStorageTRES`` lists the GPUs (``gres/gpu`` and each kind), so sacct and the limits
  count them;
- ``PriorityType=priority/multifactor`` with fair-share dominant (whoever used the least lately
  starts first), usage in *billing* units where a GPU-hour costs ``gpu_billing`` CPU-hours
  (``TRESBillingWeights`` on every partition), forgotten with a half-life of ``half_life``;
- ``JobSubmitPlugins=lua``: a job without a batch script (``salloc``, ``srun --pty``) is given at
  most ``interactive_time``, so a shell left open on a GPU ends on its own.

slurmdbd refuses a slurmdbd.conf that others can read, or that the Slurm user does not own: it is
written with mode 0600 and handed to that user. Its database password is generated once into a
0600 file beside the cluster's own secrets (:mod:`det_lab.cluster.secrets`).
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from det_lab.slurm.settings import AccountingSettings, SlurmSettings

DB_PASSWORD_FILE = "slurm-db-password"
#: fair-share dominant: each factor is 0..1, so the weights say how much each counts
PRIORITY_WEIGHTS = {"PriorityWeightFairshare": "10000", "PriorityWeightAge": "1000",
                    "PriorityWeightJobSize": "0", "PriorityWeightPartition": "0", "PriorityWeightQOS": "0"}


def minutes(time: str) -> int:
    """A Slurm time string (already checked) in whole minutes, at least 1 (INFINITE: no limit, 0)."""
    if time.upper() in ("INFINITE", "UNLIMITED"):
        return 0
    days, hours = 0, 0
    if "-" in time:
        d, time = time.split("-", 1)
        days = int(d)
        parts = [int(x) for x in time.split(":")]
        hours, mins, secs = (parts + [0, 0])[:3]
    else:
        parts = [int(x) for x in time.split(":")]
        hours, mins, secs = ([0, 0] + parts)[-3:] if len(parts) == 3 else (0, *(parts + [0])[:2])
    return max(days * 1440 + hours * 60 + mins + (1 if secs else 0), 1)


def gpu_tres(slurm: SlurmSettings) -> str:
    """``gres/gpu`` and each kind of GPU, as AccountingStorageTRES lists them."""
    kinds = sorted({n.gpu_kind for n in slurm.nodes if n.gpus and n.gpu_kind})
    return ",".join(["gres/gpu", *(f"gres/gpu:{k}" for k in kinds)])


def billing_weights(acct: AccountingSettings) -> str:
    """TRESBillingWeights of a partition: a GPU-hour costs ``gpu_billing`` CPU-hours."""
    return f"CPU=1.0,Mem=0.25G,GRES/gpu={acct.gpu_billing:g}"


def accounting_keys(slurm: SlurmSettings) -> dict[str, str]:
    """The slurm.conf keys of accounting, priorities and the interactive limit (empty without accounting)."""
    acct = slurm.accounting
    if acct is None:
        return {}
    return {
        "AccountingStorageType": "accounting_storage/slurmdbd",
        "AccountingStorageHost": acct.dbd_host or slurm.controller_addr or slurm.controller,
        "AccountingStoragePort": str(acct.dbd_port),
        "AccountingStorageEnforce": "associations,limits,qos,safe",
        "AccountingStorageTRES": gpu_tres(slurm),
        "JobAcctGatherType": "jobacct_gather/cgroup",
        "JobAcctGatherFrequency": "30",
        "PriorityType": "priority/multifactor",
        "PriorityDecayHalfLife": acct.half_life,
        "PriorityMaxAge": "7-0",
        **PRIORITY_WEIGHTS,
        "JobSubmitPlugins": "lua",
    }


def render_job_submit_lua(slurm: SlurmSettings) -> str:
    """job_submit.lua: a job without a batch script (salloc, srun --pty) gets at most interactive_time."""
    assert slurm.accounting is not None
    limit = minutes(slurm.accounting.interactive_time)
    return f"""-- job_submit.lua rendered by 'det-lab slurm config'; next to slurm.conf on the controller.
-- An interactive job (salloc, srun --pty: no batch script) ends after {slurm.accounting.interactive_time}
-- ({limit} min), so a shell left open does not hold a GPU overnight (slurm.yaml accounting.interactive_time).
local INTERACTIVE_MINUTES = {limit}

function slurm_job_submit(job_desc, part_list, submit_uid)
    if job_desc.script == nil or job_desc.script == "" then
        local asked = job_desc.time_limit
        if asked == nil or asked == slurm.NO_VAL or asked > INTERACTIVE_MINUTES then
            job_desc.time_limit = INTERACTIVE_MINUTES
            slurm.log_user("interactive job: time limit %d min (the lab's limit for salloc and srun --pty)",
                           INTERACTIVE_MINUTES)
        end
    end
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
end

return slurm.SUCCESS
"""


def password_file(acct: AccountingSettings, private: Path) -> Path:
    """Where the database password lives: the configured file, else ``<private dir>/slurm-db-password``."""
    return acct.password_file or private / DB_PASSWORD_FILE


def db_password(acct: AccountingSettings, env: dict[str, str] | None = None) -> tuple[Path, str, bool]:
    """The database password (generated once, 0600): its file, value and whether it was just made."""
    from det_lab.cluster.secrets import (
        DB_PASSWORD_LENGTH,
        ensure_private_dir,
        ensure_secret,
        private_dir,
    )

    private = private_dir(env)
    path = password_file(acct, private)
    if acct.password_file is None:
        ensure_private_dir(private)
    secret = ensure_secret(path, DB_PASSWORD_LENGTH)
    return path, secret.value, secret.created


def render_slurmdbd_conf(slurm: SlurmSettings, password: str) -> str:
    """slurmdbd.conf: where slurmdbd listens and the database it writes to."""
    acct = slurm.accounting
    assert acct is not None
    keys = {
        "AuthType": "auth/munge",
        "DbdHost": acct.dbd_host or slurm.controller,
        **({"DbdAddr": slurm.controller_addr} if acct.dbd_host is None and slurm.controller_addr else {}),
        "DbdPort": str(acct.dbd_port),
        "SlurmUser": slurm.slurm_user,
        "StorageType": "accounting_storage/mysql",
        "StorageHost": acct.storage_host,
        "StoragePort": str(acct.storage_port),
        "StorageUser": acct.storage_user,
        "StoragePass": password,
        "StorageLoc": acct.storage_db,
        "PidFile": "/run/slurmdbd.pid",
        "LogFile": str(slurm.log_dir / "slurmdbd.log"),
        **acct.dbd_extra,
    }
    src = f" from {slurm.source}" if slurm.source else ""
    lines = [f"# slurmdbd.conf rendered by 'det-lab slurm config'{src}.",
             "# Mode 0600, owned by the Slurm user: slurmdbd refuses it otherwise. It holds the database password."]
    return "\n".join(lines + [f"{k}={v}" for k, v in keys.items()]) + "\n"


def write_slurmdbd_conf(path: Path, text: str, slurm_user: str) -> str | None:
    """Write slurmdbd.conf with mode 0600 and hand it to the Slurm user; a note when that cannot be done."""
    from det_lab.cluster.secrets import write_private

    write_private(path, text)  # 0600 from its creation: it holds the database password
    try:
        entry = pwd.getpwnam(slurm_user)
        st = os.stat(path)
        if (st.st_uid, st.st_gid) != (entry.pw_uid, entry.pw_gid):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    except KeyError:
        return f"user {slurm_user} does not exist here: chown {slurm_user} {path} on the slurmdbd machine"
    except PermissionError:
        return f"not allowed to hand {path} to {slurm_user}: run 'chown {slurm_user} {path}' as root"
    return None


def database_sql(slurm: SlurmSettings, password: str = "<password>") -> list[str]:
    """What the database administrator runs once (MariaDB, as root)."""
    acct = slurm.accounting
    assert acct is not None
    host = "localhost" if acct.storage_host in ("localhost", "127.0.0.1") else "%"
    who = f"'{acct.storage_user}'@'{host}'"
    return [f"CREATE DATABASE IF NOT EXISTS {acct.storage_db};",
            f"CREATE USER IF NOT EXISTS {who} IDENTIFIED BY '{password}';",
            f"GRANT ALL ON {acct.storage_db}.* TO {who};"]


def accounting_notes(slurm: SlurmSettings, password_path: Path | None) -> list[str]:
    """The database set-up and the start order, for ``det-lab slurm config``."""
    acct = slurm.accounting
    if acct is None:
        return []
    pw = f"the password in {password_path}" if password_path else "the database password"
    dbd = acct.dbd_host or slurm.controller
    return [
        f"MariaDB on {acct.storage_host}: in its mysqld section set innodb_buffer_pool_size=1024M, "
        "innodb_log_file_size=64M, innodb_lock_wait_timeout=900 (Slurm's accounting guide); then as root run: "
        + " ".join(database_sql(slurm)) + f" (with {pw})",
        f"slurmdbd.conf goes next to slurm.conf on {dbd}, mode 0600, owned by {slurm.slurm_user}; "
        "job_submit.lua next to slurm.conf on the controller",
        f"start order: MariaDB, then slurmdbd on {dbd} (wait for port {acct.dbd_port}), then slurmctld, then slurmd; "
        "slurmctld refuses to start the first time if slurmdbd does not answer",
        "then 'det-lab slurm accounts' creates the projects' accounts, the members and their GPU limits "
        "(sacctmgr); '--dry-run' shows the plan first",
    ]
