"""A stand-in for a Determined 0.38.1 master: the REST endpoints Determined's own CLI, SDK and harness
call, served by ``http.server`` on 127.0.0.1 in a thread, over the in-memory records and rules of
tests/standin/master_state.py.

What grpc-gateway does in front of the real master is reproduced here: the REST paths of
proto/src/determined/api/v1/api.proto, camelCase JSON, server streams as one ``{"result": ...}``
object per line, and errors as ``{"error": {"code", "reason", "error"}}`` with the HTTP status of
the gRPC code, a plain (codes.Unknown) error turned into Internal, HTTP 500
(master/internal/grpcutil/errors.go:37-66). Authentication is a bearer token from login, or the
allocation token a task sends (``Grpc-Metadata-x-allocation-token``, harness common/api/_session.py:331).

The endpoints are in master_client_api.py (what a user's CLI/SDK calls), master_task_api.py (what a
trial's harness calls), master_webui_api.py (what only the Web UI calls: continuing an experiment)
and master_ntsc.py (commands and notebooks with a config template); each names the Determined
handler it follows.
"""

from __future__ import annotations

import json
import re
import threading
import traceback
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs, urlsplit

from tests.standin.master_state import State, User

VERSION = "0.38.1"
#: google.golang.org/grpc/codes -> HTTP (grpc-gateway runtime.HTTPStatusFromCode)
HTTP_STATUS = {3: 400, 5: 404, 6: 409, 7: 403, 9: 400, 12: 501, 13: 500, 16: 401}
REASONS = {3: "InvalidArgument", 5: "NotFound", 6: "AlreadyExists", 7: "PermissionDenied",
           9: "FailedPrecondition", 12: "Unimplemented", 13: "Internal", 16: "Unauthenticated"}


class ApiError(Exception):
    """A gRPC status error: ``code`` (codes.*), ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Request:
    method: str
    path: str
    groups: dict[str, str]
    query: dict[str, list[str]]
    body: Any
    raw: bytes
    user: User | None
    master: Master

    def q(self, *names: str, default: str | None = None) -> str | None:
        """A query parameter under any of its spellings (the harness sends some in snake_case)."""
        for name in names:
            if name in self.query:
                return self.query[name][0]
        return default

    def qlist(self, name: str) -> list[str]:
        return self.query.get(name, [])


Handler = Callable[[Request], Any]
Route = tuple[str, "re.Pattern[str]", Handler, bool]


def route(table: list[Route], method: str, pattern: str, *, auth: bool = True) -> Callable[[Handler], Handler]:
    """Register ``fn`` for ``method`` on the path ``pattern`` ({name} segments become groups)."""
    regex = re.compile("^" + re.sub(r"{(\w+)}", r"(?P<\1>[^/]+)", pattern) + "$")

    def deco(fn: Handler) -> Handler:
        table.append((method, regex, fn, auth))
        return fn
    return deco


class Stream:
    """A server-streaming reply: its items are written one JSON line each as they come."""

    def __init__(self, items: Iterable[dict[str, Any]]) -> None:
        self.items = items


class Raw:
    """A non-JSON reply (the checkpoint tarball of GET /checkpoints/{uuid})."""

    def __init__(self, data: bytes, content_type: str) -> None:
        self.data, self.content_type = data, content_type


class Master:
    """The master stand-in. ``config``: a master.yaml dict (task_container_defaults, checkpoint_storage,
    resource_pools); ``searcher_factory(config, seed)``: the searcher (tests/standin/searcher.py's
    ``make_searcher`` by default). ``stop_preempts``: preempt a trial the searcher stops (the behaviour
    of determined-ai/determined#9605, reverted before 0.38.0: off, as 0.38.1 does)."""

    def __init__(self, config: dict[str, Any] | None = None, *, port: int = 0,
                 searcher_factory: Callable[[dict[str, Any], int], Any] | None = None,
                 stop_preempts: bool = False, det_user: str = "determined",
                 agent_user_group: dict[str, Any] | None = None, host: str = "127.0.0.1") -> None:
        from tests.standin import master_client_api, master_ntsc, master_task_api, master_webui_api

        if searcher_factory is None:
            searcher_factory = _make_searcher
        self.config = dict(config or {})
        self.state = State(self.config, searcher_factory, stop_preempts=stop_preempts)
        self.cluster_id, self.master_id = str(uuid.uuid4()), str(uuid.uuid4())
        self.routes: list[Route] = (master_client_api.ROUTES + master_task_api.ROUTES + master_webui_api.ROUTES
                                    + master_ntsc.ROUTES)
        self.unserved: list[str] = []
        self.state.add_user("admin", admin=True)
        self.state.add_user(det_user, admin=True, agent_user_group=agent_user_group)
        self.host = host  # where it listens: another address than the loopback for agents on other hosts
        self.httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="det-standin-master", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.state.close()

    def __enter__(self) -> Master:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def authenticate(self, headers: Any) -> User | None:
        for name in ("Authorization", "Grpc-Metadata-x-allocation-token"):
            value = headers.get(name) or ""
            if value.startswith("Bearer "):
                return self.state.sessions.get(value[len("Bearer "):])
        return None


def _make_searcher(config: dict[str, Any], seed: int) -> Any:
    """tests/standin/searcher.py's searcher, imported when the first experiment needs one."""
    from tests.standin.searcher import make_searcher
    return make_searcher(config, seed)


def _make_handler(master: Master) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # a long poll whose caller has gone
                pass

        def _error(self, code: int, message: str) -> None:
            if code == 2:  # grpcutil/errors.go:44-50: Unknown becomes Internal
                code = 13
            body = {"error": {"code": code, "reason": REASONS.get(code, "Unknown"), "error": message}}
            self._send(HTTP_STATUS.get(code, 500), json.dumps(body).encode() + b"\n")

        def _dispatch(self) -> None:
            url = urlsplit(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            for method, regex, fn, auth in master.routes:
                m = regex.match(url.path)
                if m is None or method != self.command:
                    continue
                user = master.authenticate(self.headers)
                if auth and user is None:
                    return self._error(16, "invalid credentials")
                try:
                    body = json.loads(raw) if raw.strip() else {}
                    req = Request(self.command, url.path, m.groupdict(), parse_qs(url.query), body, raw, user, master)
                    result = fn(req)
                except ApiError as exc:
                    return self._error(exc.code, exc.message)
                except Exception as exc:  # a stand-in bug: Internal, as grpc recovery reports a panic
                    traceback.print_exc()
                    return self._error(13, f"{type(exc).__name__}: {exc}")
                if isinstance(result, Stream):
                    return self._stream(result)
                if isinstance(result, Raw):
                    return self._send(200, result.data, result.content_type)
                return self._send(200, json.dumps(result if result is not None else {}).encode())
            master.unserved.append(f"{self.command} {url.path}")
            self._error(5, f"Not Found: {self.command} {url.path} is not served by the stand-in")

        def _stream(self, stream: Stream) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for item in stream.items:
                    self.wfile.write(json.dumps({"result": item}).encode() + b"\n")
                    self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True

        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _dispatch

    return _Handler
