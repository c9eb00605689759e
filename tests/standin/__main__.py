"""``python -m tests.standin --root DIR [--port N] [--slots N] [--agent-user NAME] [--wheel-dir DIR]``:
a master stand-in and an agent stand-in in the foreground, for trying Determined's CLI and SDK by
hand. Prints ``DET_MASTER=http://127.0.0.1:PORT`` once the master answers; user ``determined`` (empty
password) is linked to the Unix user who started it, or ``--agent-user``. Checkpoints go to
``DIR/checkpoints`` (shared_fs). With ``--wheel-dir`` (a Determined 0.38.1 harness wheel) tasks run
through Determined's whole container chain (tests/task_standin.py ``run_allocation``); without it, on
this machine's harness (tests/standin/agent.py ``HostRunner``). SIGTERM or Ctrl-C stops everything,
running tasks included.
"""

from __future__ import annotations

import argparse
import functools
import grp
import os
import pwd
import signal
import sys
import threading
import urllib.request
from pathlib import Path

from tests.standin.agent import Agent, HostRunner
from tests.standin.master import Master
from tests.standin.task_config import LinkedUser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="directory for checkpoints and task files")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--agent-user", help="the Unix user tasks run as (default: who started this)")
    parser.add_argument("--wheel-dir", type=Path, help="run tasks through run_allocation with this harness wheel")
    args = parser.parse_args(argv)

    pw = pwd.getpwnam(args.agent_user) if args.agent_user else pwd.getpwuid(os.getuid())
    group = grp.getgrgid(pw.pw_gid).gr_name
    linked = LinkedUser(pw.pw_name, pw.pw_uid, pw.pw_gid, group=group)
    storage = args.root.resolve() / "checkpoints"
    storage.mkdir(parents=True, exist_ok=True)
    if pw.pw_uid != os.getuid():
        os.chown(storage, pw.pw_uid, pw.pw_gid)
    config = {"checkpoint_storage": {"type": "shared_fs", "host_path": str(storage)}}
    master = Master(config, port=args.port, agent_user_group={
        "agentUid": pw.pw_uid, "agentGid": pw.pw_gid, "agentUser": pw.pw_name, "agentGroup": group})
    if args.wheel_dir:
        from tests.standin.task_image import make_image
        from tests.task_standin import run_allocation
        image = make_image(args.root.resolve() / "image", probe_uid=pw.pw_uid)
        runner = functools.partial(run_allocation, master=config, user=linked, image=image,
                                   wheel_dir=args.wheel_dir, master_addr=("127.0.0.1", master.port),
                                   cluster_id=master.cluster_id, master_id=master.master_id)
    else:
        runner = HostRunner(user=linked if pw.pw_uid != os.getuid() else None)
    agent = Agent(master, runner, slots=args.slots)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with urllib.request.urlopen(f"{master.url}/info", timeout=10) as reply:
            reply.read()
        print(f"DET_MASTER={master.url}", flush=True)
        stop.wait()
    finally:
        agent.close()
        master.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
