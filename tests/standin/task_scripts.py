"""The scripts a Determined 0.38.1 master puts into a trial container, re-transcribed step by step.

Each step names the line of determined-ai/determined v0.38.1 it follows. The master ships
``master/static/srv/{ship-logs.sh,ship_logs.py,task-setup.sh,entrypoint.sh}`` with every container
(master/pkg/tasks/task.go:346-383 runDirHelpersArchive; task_trial.go:54-61 the trial's entrypoint.sh):

- ``SHIP_LOGS_SH``, ``TASK_SETUP_SH``, ``ENTRYPOINT_SH``, ``COMMAND_ENTRYPOINT_SH`` (a command's, api_command.go
  LaunchCommand): every command of the originals, in their order.
- ``SHIP_LOGS_PY``: what ship_logs.py does, minimally: reach the master (``GET /api/v1/me``), run the
  child with its output piped, cut it into lines at ``\\n`` or ``\\r``, parse ``[rank=N]`` and ``LEVEL:``
  prefixes, post batches to ``POST /api/v1/task/logs`` (echoing them to its own stdout/stderr only when
  ``DET_SHIPPER_EMIT_STDOUT_LOGS`` is set, as the original), forward signals, exit with the child's
  code. Not kept: the ``/ship_logs`` escape hatch, TLS, and the retry schedule beyond one try per
  batch (a failed post is logged and dropped here, retried for ten minutes there).
- ``NETFWD_PY`` is not Determined's: the stand-in's relay that lets the task reach the master from its
  own network namespace (see tests/standin/task_run.py); it starts the container's command after it.
"""

SHIP_LOGS_SH = r"""#!/usr/bin/env bash
# master/static/srv/ship-logs.sh, re-transcribed for det_lab's task stand-in
# :12 any failure ends the script
set -e
# :14-16 the image's python3 unless the task names another interpreter
if [ -z "$DET_PYTHON_EXECUTABLE" ]; then
    export DET_PYTHON_EXECUTABLE="python3"
fi
# :18-19 the first argument is ship_logs.py, the rest is the command it runs
ship_logs="$1"
shift
# :21 the shipper replaces this shell
exec "$DET_PYTHON_EXECUTABLE" "$ship_logs" "$@"
"""

TASK_SETUP_SH = r"""#!/usr/bin/env bash
# master/static/srv/task-setup.sh, re-transcribed for det_lab's task stand-in (sourced by entrypoint.sh)
# :3-4 well-known names for this shell's stdout and stderr
STDOUT_FILE=/run/determined/train/logs/stdout.log
STDERR_FILE=/run/determined/train/logs/stderr.log
# :6 their directory
mkdir -p "$(dirname "$STDOUT_FILE")" "$(dirname "$STDERR_FILE")"
# :12-13 link them to this process's fd 1 and 2
ln -sf /proc/$$/fd/1 "$STDOUT_FILE"
ln -sf /proc/$$/fd/2 "$STDERR_FILE"
# :15 scripts pip installs with --user come first
export PATH="/run/determined/pythonuserbase/bin:$PATH"
# :16-18 the interpreter: python3 unless the task names one
if [ -z "$DET_PYTHON_EXECUTABLE" ]; then
    export DET_PYTHON_EXECUTABLE="python3"
fi
# :20-24 no interpreter: two JSON log lines and the end of the task
if ! "$DET_PYTHON_EXECUTABLE" --version >/dev/null 2>&1; then
    echo "{\"log\": \"error: unable to find python3 as '$DET_PYTHON_EXECUTABLE'\n\", \"timestamp\": \"$(date --rfc-3339=seconds)\"}" >&2
    echo "{\"log\": \"please install python3 or set the environment variable DET_PYTHON_EXECUTABLE=/path/to/python3\n\", \"timestamp\": \"$(date --rfc-3339=seconds)\"}" >&2
    exit 1
fi
# :26-27 the master's harness wheel, installed into PYTHONUSERBASE (a failure does not stop this script)
if [ -z "$DET_SKIP_PIP_INSTALL" ]; then
    "$DET_PYTHON_EXECUTABLE" -m pip install -q --user /opt/determined/wheels/determined*.whl
else
    # :29-32 skipped only if the image has determined
    if ! "$DET_PYTHON_EXECUTABLE" -c "import determined" >/dev/null 2>&1; then
        echo "{\"log\": \"error: unable run without determined package\n\", \"timestamp\": \"$(date --rfc-3339=seconds)\"}" >&2
        exit 1
    fi
fi
# :35-41 Slurm only: tell the master this container runs
if [ "$DET_RESOURCES_TYPE" == "slurm-job" ]; then
    "$DET_PYTHON_EXECUTABLE" -m determined.exec.prep_container --notify_container_running
fi
# :49-55 HOME is "/" when Docker found no passwd entry: ask NSS (libnss_determined), else the workdir
if [ "$HOME" = "/" ]; then
    HOME="$(
        set -o pipefail
        getent passwd "$UID" | cut -d: -f6
    )" || HOME="$PWD"
    export HOME
fi
# :57 the master's task-container-defaults startup hook
TCD_STARTUP_HOOK="$DET_RUN_DIR/dynamic-tcd-startup-hook.sh"
"""

ENTRYPOINT_SH = r"""#!/bin/bash
# master/static/srv/entrypoint.sh, re-transcribed for det_lab's task stand-in
# :5 the common set-up, in this shell
source /run/determined/task-setup.sh
# :7 from here any failure ends the task
set -e
# :9 the context from the master into the workdir, resources info, proxy address
"$DET_PYTHON_EXECUTABLE" -m determined.exec.prep_container --download_context_directory --resources --proxy
# :11 the context's hook, relative to the workdir
STARTUP_HOOK="startup-hook.sh"
# :12-15 both hooks sourced (so under set -e), traced
set -x
test -f "${TCD_STARTUP_HOOK}" && source "${TCD_STARTUP_HOOK}"
test -f "${STARTUP_HOOK}" && source "${STARTUP_HOOK}"
set +x
# :18 rendezvous last, so all containers' launch layers start together
"$DET_PYTHON_EXECUTABLE" -m determined.exec.prep_container --rendezvous
# :20 the launch layer replaces this shell
exec "$DET_PYTHON_EXECUTABLE" -m determined.exec.launch "$@"
"""

COMMAND_ENTRYPOINT_SH = r"""#!/usr/bin/env bash
# master/static/srv/command-entrypoint.sh, re-transcribed for det_lab's task stand-in
# :3 the common set-up, in this shell
source /run/determined/task-setup.sh
# :5 from here any failure ends the task
set -e
# :11 the proxy address and the command's files (det cmd run --context) into the workdir
"$DET_PYTHON_EXECUTABLE" -m determined.exec.prep_container --proxy --download_context_directory
# :13-17 both hooks sourced, traced
STARTUP_HOOK="startup-hook.sh"
set -x
test -f "${TCD_STARTUP_HOOK}" && source "${TCD_STARTUP_HOOK}"
test -f "${STARTUP_HOOK}" && source "${STARTUP_HOOK}"
set +x
# :19-23 one argument is a shell command line, several an argv
if [ "$#" -eq 1 ]; then
    exec /bin/sh -c "$@"
else
    exec "$@"
fi
"""

SHIP_LOGS_PY = r'''"""master/static/srv/ship_logs.py, minimally re-transcribed for det_lab's task stand-in (stdlib only)."""
import datetime, json, logging, os, queue, re, signal, subprocess, sys, threading, time, urllib.request

LOG_FORMAT = "%(levelname)s: [%(process)s] %(name)s: %(message)s"  # :45
RANK = re.compile(r"(?P<space1> ?)\[rank=(?P<rank_id>([0-9]+))\](?P<space2> ?)(?P<log>.*)", re.DOTALL)  # :53-55
LEVEL = re.compile(r"(?P<space1> ?)(?P<level>(DEBUG|INFO|WARNING|ERROR|CRITICAL)):(?P<space2> ?)(?P<log>.*)",
                   re.DOTALL)  # :60-63
LINEEND = re.compile(rb"[\r\n]")  # :64


def lines(fd):  # :92-155 read_newlines_or_carriage_returns: a line ends at \n or \r, always emitted with \n
    limit, chunks, nread = 8191, [], 0
    while True:
        buf = fd.read(limit - nread)
        if not buf:
            break
        while buf:
            m = LINEEND.search(buf)
            if m is None:
                chunks.append(buf)
                nread += len(buf)
                break
            chunks.append(buf[:m.start()] + b"\n")
            yield b"".join(chunks).decode("utf8", "replace")
            chunks, nread, buf = [], 0, buf[m.end():]
        if nread >= limit:
            yield b"".join(chunks + [b"\n"]).decode("utf8", "replace")
            chunks, nread = [], 0
    if chunks:
        yield b"".join(chunks + [b"\n"]).decode("utf8", "replace")


class Shipper:
    def __init__(self, master_url, token):  # :245-275
        self.base_url = master_url.rstrip("/")
        self.headers = {"Grpc-Metadata-x-allocation-token": f"Bearer {token}"}

    def post(self, logs):  # :339-375 (one try per batch here)
        req = urllib.request.Request(f"{self.base_url}/api/v1/task/logs", json.dumps({"logs": logs}).encode(),
                                     {**self.headers, "Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()
        except Exception:
            logging.error("failed to ship logs to master", exc_info=True)

    def assert_master_is_reachable(self):  # :405-479
        for delay in [0, 1, 5, 10, 15]:
            time.sleep(delay)
            try:
                req = urllib.request.Request(f"{self.base_url}/api/v1/me", headers=self.headers)
                with urllib.request.urlopen(req, timeout=10) as resp:
                    resp.read()
                return
            except Exception as e:
                logging.error(f"Unable to reach the master at DET_MASTER={self.base_url}.  {e!r}")
        raise RuntimeError("failed to ever reach master")

    def ship_special(self, msg, metadata, emit):  # :377-403
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        logs = []
        for line in (msg if msg.endswith("\n") else msg + "\n").splitlines(keepends=True):
            if emit:
                print(line, end="", file=sys.stderr)
            logs.append({"timestamp": now, "log": line, "level": "ERROR", "stdtype": "stderr", **metadata})
        self.post(logs)


def collect(fd, stdtype, emit, metadata, logq):  # :158-223 Collector
    out = sys.stdout if stdtype == "stdout" else sys.stderr
    for line in lines(fd):
        log = {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "stdtype": stdtype, **metadata}
        if emit:
            print(line, file=out, flush=True, end="")
        m = RANK.match(line)
        if m:
            log["rank_id"], line = int(m.group("rank_id")), m.group("log")
        m = LEVEL.match(line)
        if m:
            log["level"], line = f"LOG_LEVEL_{m.group('level')}", m.group("log")
        log["log"] = line
        logq.put(log)
    logq.put(None)


def ship(shipper, logq):  # :304-337: a batch every second or every 1000 lines, until both streams end
    eofs = 0
    while eofs < 2:
        logs, deadline = [], time.time() + 1
        while eofs < 2 and len(logs) < 1000 and time.time() < deadline:
            try:
                log = logq.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                break
            if log is None:
                eofs += 1
            else:
                logs.append(log)
        if logs:
            shipper.post(logs)


def main(master_url, metadata, token, emit, cmd, log_wait_time):  # :500-705
    shipper = Shipper(master_url, token)
    shipper.assert_master_is_reachable()  # :531
    try:  # :534-552
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    except FileNotFoundError:
        shipper.ship_special(f"FileNotFoundError executing {cmd}", metadata, emit)
        return 127
    except PermissionError:
        shipper.ship_special(f"PermissionError executing {cmd}", metadata, emit)
        return 126
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH):
        signal.signal(sig, lambda signum, frame: p.send_signal(signum))  # :563-574
    logq = queue.Queue()
    collectors = [threading.Thread(target=collect, args=(f, t, emit, metadata, logq), daemon=True)
                  for f, t in ((p.stdout, "stdout"), (p.stderr, "stderr"))]
    shipping = threading.Thread(target=ship, args=(shipper, logq), daemon=True)
    for t in collectors + [shipping]:
        t.start()
    exit_code = p.wait()
    for t in collectors:  # :674: one second for the collectors after the child exits
        t.join(timeout=1)
    if any(t.is_alive() for t in collectors):
        logq.put(None)
        logq.put(None)
    shipping.join(timeout=log_wait_time)  # :675: DET_LOG_WAIT_TIME for the shipper
    return 128 - exit_code if exit_code < 0 else exit_code  # :684-686


if __name__ == "__main__":  # :747-798
    try:
        logging.basicConfig(format=LOG_FORMAT, stream=sys.stderr)
        metadata = json.loads(os.environ["DET_TASK_LOGGING_METADATA"])
        metadata["container_id"] = os.environ.get("DET_CONTAINER_ID", "")
        metadata["agent_id"] = os.environ.get("DET_AGENT_ID", "")
        metadata["source"] = "task"
        exit_code = main(os.environ["DET_MASTER"], metadata, os.environ["DET_SESSION_TOKEN"],
                         bool(os.environ.get("DET_SHIPPER_EMIT_STDOUT_LOGS")), sys.argv[1:],
                         int(os.environ.get("DET_LOG_WAIT_TIME", "30")))
    except Exception:
        logging.error("ship_logs.py crashed!", exc_info=True)
        sys.exit(80)
    sys.exit(exit_code)
'''

NETFWD_PY = r'''"""det_lab task stand-in (not Determined's): relay TCP connections to the master's address inside the
task's network namespace to a Unix socket the agent stand-in serves, then exec the container's command.
usage: netfwd.py [--listen IP:PORT --unix PATH] -- CMD ARGS..."""
import os, socket, sys, threading


def pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(srv, path):
    while True:
        conn, _ = srv.accept()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(path)
        except OSError:
            conn.close()
            continue
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()


args = sys.argv[1:]
cmd = args[args.index("--") + 1:]
pairs = list(zip(args[:args.index("--")][::2], args[:args.index("--")][1::2]))
listens = [v for k, v in pairs if k == "--listen"]
unixes = [v for k, v in pairs if k == "--unix"]
for listen, unix in zip(listens, unixes):  # one relay per address: the master's, then the services'
    host, port = listen.rsplit(":", 1)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, int(port)))
    srv.listen(64)
    if os.fork() == 0:  # the relay lives on beside the container's command, until the sandbox ends
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        serve(srv, unix)
        os._exit(0)
    srv.close()
os.execv(cmd[0], cmd)
'''
