"""``det-lab slurm accounts``: Slurm's accounts, users and QOS made to match the lab config.

What det_lab manages, and how it knows: one account per project (``Description=det-lab project
<name>``), one QOS per per-user GPU limit (``det-lab-gpu<N>``, ``-deny`` with ``DenyOnLimit``,
``Description=det-lab ...``) and the members' associations inside those accounts. Anything else
(the ``root`` account and user, accounts and QOS made by hand) is read but never changed or removed.

The whole plan is read and computed first; a second run with the same config plans nothing.
Every change goes through ``sacctmgr -i`` (no prompt); a repeated add is checked against
``sacctmgr show`` beforehand rather than trusted to its exit code.
"""

from __future__ import annotations

import pwd
import subprocess
from dataclasses import dataclass, field

from det_lab.errors import UserError
from det_lab.slurm.settings import AccountingSettings, SlurmSettings

MARK = "det-lab"
QOS_PREFIX = "det-lab-gpu"
PROTECTED_ACCOUNTS = {"root"}
PROTECTED_USERS = {"root"}


class AccountingError(UserError, RuntimeError):
    """sacctmgr is missing, cannot reach slurmdbd, or refused: one line."""


def sacctmgr(*argv: str, timeout: float = 60) -> str:
    """Run ``sacctmgr -i -P -n ARGV``; its output, or AccountingError with sacctmgr's own words."""
    import shutil

    exe = shutil.which("sacctmgr")
    if exe is None:
        raise AccountingError("sacctmgr not found on PATH: install Slurm's client (apt-get install slurm-client)")
    try:
        proc = subprocess.run([exe, "-i", "-P", "-n", *argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AccountingError(f"sacctmgr did not answer in {timeout:.0f} s: is slurmdbd running?") from None
    err = " ".join(line.removeprefix("sacctmgr: error: ").strip() for line in proc.stderr.splitlines()
                   if "error" in line.lower())
    if proc.returncode != 0 or err:
        msg = err or proc.stdout.strip() or f"exit code {proc.returncode}"
        if any(s in msg.lower() for s in ("connection refused", "persistinit", "unable to connect", "slurmdbd")):
            msg += " (is slurmdbd running, and its database? start order: MariaDB, slurmdbd, slurmctld)"
        raise AccountingError(f"sacctmgr {' '.join(argv[:3])}: {msg}")
    return proc.stdout


def running_cluster_name(timeout: float = 30) -> str | None:
    """The ClusterName of the Slurm this machine talks to (``scontrol show config``); None when
    scontrol is missing or slurmctld does not answer."""
    import shutil

    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, "show", "config"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName" and value.strip():
            return value.strip()
    return None


def with_cluster_name(slurm: SlurmSettings) -> SlurmSettings:
    """``slurm`` naming the cluster slurmdbd knows the running one by: slurm.yaml's ``cluster_name``
    when it names one (it must be the running cluster's), else the running cluster's ClusterName.
    A slurm.yaml naming none, with no cluster answering, is one line: changes made to a cluster name
    slurmdbd does not run would set no limit anywhere."""
    where = slurm.source or "the Slurm config"
    running = running_cluster_name()
    if "cluster_name" in slurm.model_fields_set:
        if running is not None and running != slurm.cluster_name:
            raise AccountingError(f"{where}: cluster_name {slurm.cluster_name}, but the running Slurm cluster is "
                                  f"{running} (scontrol show config): set cluster_name: {running}")
        return slurm
    if running is None:
        raise AccountingError(f"{where} names no cluster_name and scontrol show config did not answer: set "
                              f"cluster_name: to slurm.conf's ClusterName")
    return slurm.model_copy(update={"cluster_name": running})


def _rows(text: str, n: int) -> list[list[str]]:
    return [(line.split("|") + [""] * n)[:n] for line in text.splitlines() if line.strip()]


@dataclass
class SlurmState:
    """What slurmdbd holds for one cluster, as ``sacctmgr show`` prints it."""

    clusters: set[str] = field(default_factory=set)
    accounts: dict[str, str] = field(default_factory=dict)  # name -> description
    qos: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # name -> (description, MaxTRESPU, flags)
    account_assocs: dict[str, tuple[str, str]] = field(default_factory=dict)  # account -> (fairshare, GrpTRES)
    user_assocs: dict[tuple[str, str], tuple[str, str, str]] = field(default_factory=dict)  # (user, account) -> (fs, qos, defqos)
    default_accounts: dict[str, str] = field(default_factory=dict)  # user -> default account

    def managed_accounts(self) -> set[str]:
        return {a for a, d in self.accounts.items()
                if d.startswith(f"{MARK} project") and a not in PROTECTED_ACCOUNTS}

    def managed_qos(self) -> set[str]:
        return {q for q, (d, _, _) in self.qos.items() if q.startswith(QOS_PREFIX) and d.startswith(MARK)}


def read_state(cluster: str) -> SlurmState:
    """Slurm's accounts, QOS, associations and users (AccountingError when slurmdbd does not answer)."""
    st = SlurmState()
    st.clusters = {r[0] for r in _rows(sacctmgr("show", "cluster", "format=Cluster"), 1)}
    for name, descr in _rows(sacctmgr("show", "account", "format=Account,Descr"), 2):
        st.accounts[name] = descr
    for name, descr, maxtres, flags in _rows(sacctmgr("show", "qos", "format=Name,Descr,MaxTRESPU,Flags"), 4):
        st.qos[name] = (descr, maxtres, flags)
    assoc = sacctmgr("show", "assoc", f"cluster={cluster}", "format=Account,User,Fairshare,GrpTRES,QOS,DefaultQOS")
    for account, user, fs, grp, qos, defqos in _rows(assoc, 6):
        if user:
            st.user_assocs[(user, account)] = (fs, ",".join(sorted(filter(None, qos.split(",")))), defqos)
        else:
            st.account_assocs[account] = (fs, grp)
    for user, default in _rows(sacctmgr("show", "user", "format=User,DefaultAccount"), 2):
        st.default_accounts[user] = default
    return st


def gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def qos_name(limit: int, deny: bool) -> str:
    return f"{QOS_PREFIX}{limit}" + ("-deny" if deny else "")


def _gpu_tres(limit: int | None) -> str:
    return f"gres/gpu={limit}" if limit is not None else ""


@dataclass(frozen=True)
class Step:
    """One change: what it does in words and the sacctmgr command that does it."""

    verb: str  # add, change, remove
    what: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.verb} {self.what}"


@dataclass
class Plan:
    steps: list[Step] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, verb: str, what: str, *argv: str) -> None:
        self.steps.append(Step(verb, what, argv))


def _desired_user_assocs(acct: AccountingSettings) -> dict[tuple[str, str], tuple[str, str, str]]:
    out = {}
    for m in acct.members:
        limit = acct.gpu_limit(m)
        qos = qos_name(limit, acct.deny_on_limit) if limit is not None else "normal"
        for project in m.projects:
            out[(m.user, project)] = (str(acct.fairshare(m)), qos, qos)
    return out


def plan(slurm: SlurmSettings, st: SlurmState) -> Plan:
    """The changes that make ``st`` match the config's accounting section, in the order they apply."""
    acct = slurm.accounting
    assert acct is not None
    cluster = slurm.cluster_name
    p = Plan()
    for m in acct.members:
        try:
            pwd.getpwnam(m.user)
        except KeyError:
            p.warnings.append(f"member {m.user} is not a Unix user on this machine (getent passwd {m.user}): "
                              f"added anyway; their jobs run once the name exists on the nodes")
    for account in acct.accounts():
        if account in st.accounts and account not in st.managed_accounts():
            raise AccountingError(f"account {account} exists in Slurm but det-lab did not make it: rename the "
                                  f"project or remove the account by hand (sacctmgr delete account {account})")
    if cluster not in st.clusters:
        p.add("add", f"cluster {cluster}", "add", "cluster", cluster)

    # QOS: one per limit (and DenyOnLimit)
    limits = sorted({lim for m in acct.members if (lim := acct.gpu_limit(m)) is not None})
    wanted_qos = {qos_name(n, acct.deny_on_limit): n for n in limits}
    for name, n in wanted_qos.items():
        if name not in st.qos:
            flags = ["Flags=DenyOnLimit"] if acct.deny_on_limit else []
            p.add("add", f"QOS {name} (each user at most {gpus(n)}"
                         f"{', refused at submission beyond' if acct.deny_on_limit else ''})",
                  "add", "qos", name, f"Description={MARK} per-user GPU limit {n}", f"MaxTRESPerUser=gres/gpu={n}",
                  *flags)

    # accounts: one per project
    for account in acct.accounts():
        lim = acct.projects.get(account)
        fs, grp = str(lim.fairshare if lim else 1), _gpu_tres(lim.gpu_limit if lim else None)
        words = f"fairshare {fs}, " + (f"the project at most {gpus(lim.gpu_limit)}" if grp else "no project GPU limit")
        if account not in st.accounts:
            p.add("add", f"account {account} ({words})", "add", "account", account, f"cluster={cluster}",
                  f"Description={MARK} project {account}", f"Organization={MARK}", f"Fairshare={fs}",
                  *([f"GrpTRES={grp}"] if grp else []))
        elif st.account_assocs.get(account) != (fs, grp):
            p.add("change", f"account {account} ({words})", "modify", "account", "where", f"name={account}",
                  f"cluster={cluster}", "set", f"Fairshare={fs}", f"GrpTRES={grp or 'gres/gpu=-1'}")

    # members' associations
    wanted = _desired_user_assocs(acct)
    for m in acct.members:
        limit = acct.gpu_limit(m)
        words = f"at most {gpus(limit)}" if limit is not None else "no GPU limit"
        for project in m.projects:
            fs, qos, defqos = wanted[(m.user, project)]
            have = st.user_assocs.get((m.user, project))
            sets = [f"Fairshare={fs}", f"QOS={qos}", f"DefaultQOS={defqos}"]
            if have is None:
                first = m.user not in st.default_accounts
                p.add("add", f"user {m.user} to account {project} ({words}, fairshare {fs})", "add", "user", m.user,
                      f"account={project}", f"cluster={cluster}",
                      *([f"DefaultAccount={m.projects[0]}"] if first else []), *sets)
            elif have != (fs, qos, defqos):
                p.add("change", f"user {m.user} in account {project} ({words}, fairshare {fs})", "modify", "user",
                      "where", f"name={m.user}", f"account={project}", f"cluster={cluster}", "set", *sets)
        if m.user not in PROTECTED_USERS and st.default_accounts.get(m.user, m.projects[0]) != m.projects[0]:
            p.add("change", f"user {m.user}'s default account to {m.projects[0]}", "modify", "user", "where",
                  f"name={m.user}", "set", f"DefaultAccount={m.projects[0]}")

    # removals: only associations in det-lab's accounts, only det-lab's accounts and QOS
    managed = st.managed_accounts()
    gone = sorted(k for k in st.user_assocs if k[1] in managed and k not in wanted and k[0] not in PROTECTED_USERS)
    for user, account in gone:
        keeps = [a for (u, a) in st.user_assocs if u == user and (u, a) not in gone]
        if keeps and st.default_accounts.get(user) == account and acct.member(user) is None:
            p.add("change", f"user {user}'s default account to {keeps[0]}", "modify", "user", "where",
                  f"name={user}", "set", f"DefaultAccount={keeps[0]}")
        if not keeps:
            if not any(s.argv == ("delete", "user", "where", f"name={user}") for s in p.steps):
                p.add("remove", f"user {user} (no longer a member)", "delete", "user", "where", f"name={user}")
        else:
            p.add("remove", f"user {user} from account {account}", "delete", "user", "where", f"name={user}",
                  f"account={account}", f"cluster={cluster}")
    for account in sorted(managed - set(acct.accounts())):
        p.add("remove", f"account {account} (no longer a project)", "delete", "account", "where", f"name={account}")
    for name in sorted(st.managed_qos() - set(wanted_qos)):
        p.add("remove", f"QOS {name} (no member has that limit)", "delete", "qos", "where", f"name={name}")
    return p


def apply(p: Plan, echo=None) -> int:
    """Run the plan's steps in order; how many ran. On a refusal, AccountingError says which step and
    how many before it were applied."""
    for i, step in enumerate(p.steps):
        try:
            sacctmgr(*step.argv)
        except AccountingError as exc:
            done = f"; {i} earlier change(s) were applied, run again to finish" if i else "; nothing was changed"
            raise AccountingError(f"{step}: {exc}{done}") from None
        if echo:
            echo(step)
    return len(p.steps)
