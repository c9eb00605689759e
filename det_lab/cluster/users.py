"""Map Determined users to Unix identities, so tasks never write to a root_squash NFS as root.

Determined runs tasks as root unless a user is linked to an agent identity
(``det user link-with-agent-user``). On an NFS export with ``root_squash`` root becomes
``nobody`` and checkpoint writes fail; and root in a task could write anything. Linking each
team member to their uid, with the volume's group as gid, makes files land owned by them and
group-writable in the setgid volume directories.

Where the mapping comes from:

- ``users:`` in the cluster config: ``alice: alice`` (Determined user -> Unix user, looked up on
  this machine) or ``alice: {uid: 1001, gid: 2000, user: alice, group: robots}``;
- otherwise the members of the lab's ``group`` on this machine (``getent group``; NIS/LDAP
  members count), each linked under their own name.

uids must be the same on every machine (LDAP/NIS, or the same /etc/passwd), which is already
true when they share an NFS volume.
"""

from __future__ import annotations

import grp
import pwd
import shlex
from dataclasses import dataclass

from det_lab.errors import UserError
from det_lab.cluster.settings import ClusterSettings, TaskUser
from det_lab.settings import LabSettings


class UserMappingError(UserError, ValueError):
    """A user that cannot be mapped, phrased as one line."""


@dataclass(frozen=True)
class UserLink:
    det_user: str
    identity: TaskUser

    def argv(self, det: str = "det", master: str | None = None) -> list[str]:
        """The ``det user link-with-agent-user`` command for this link."""
        cmd = [det]
        if master:
            cmd += ["-m", master]
        return cmd + [
            "user", "link-with-agent-user", self.det_user,
            "--agent-uid", str(self.identity.uid), "--agent-gid", str(self.identity.gid),
            "--agent-user", self.identity.user, "--agent-group", self.identity.group,
        ]

    def command(self, det: str = "det", master: str | None = None) -> str:
        return shlex.join(self.argv(det, master))


def _volume_group(lab: LabSettings) -> grp.struct_group | None:
    if lab.group is None:
        return None
    try:
        return grp.getgrnam(lab.group)
    except KeyError:
        raise UserMappingError(f"group {lab.group!r} (lab config key 'group') does not exist on this machine") from None


def _identity(unix_user: str, group: grp.struct_group | None) -> TaskUser:
    try:
        pw = pwd.getpwnam(unix_user)
    except KeyError:
        raise UserMappingError(f"Unix user {unix_user!r} does not exist on this machine") from None
    if group is not None:
        return TaskUser(uid=pw.pw_uid, gid=group.gr_gid, user=pw.pw_name, group=group.gr_name)
    primary = grp.getgrgid(pw.pw_gid).gr_name
    return TaskUser(uid=pw.pw_uid, gid=pw.pw_gid, user=pw.pw_name, group=primary)


def user_links(lab: LabSettings, cluster: ClusterSettings) -> list[UserLink]:
    """One link per team member, sorted by Determined user name."""
    group = _volume_group(lab)
    links: list[UserLink] = []
    if cluster.users:
        for det_user, target in sorted(cluster.users.items()):
            ident = target if isinstance(target, TaskUser) else _identity(target, group)
            links.append(UserLink(det_user, ident))
    elif group is not None:
        members = set(group.gr_mem) | {p.pw_name for p in pwd.getpwall() if p.pw_gid == group.gr_gid}
        links = [UserLink(name, _identity(name, group)) for name in sorted(members)]
    else:
        raise UserMappingError("no users to link: add a 'users:' map to the cluster config "
                               "or set 'group' in the lab config")
    for link in links:
        if link.identity.uid == 0:
            raise UserMappingError(f"user {link.det_user!r} maps to uid 0 (root); tasks must not run as root")
    return links
