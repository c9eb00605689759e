"""A loopback stand-in for the part of Determined 0.38.1's master API the ``det template`` CLI
talks to, following the master's own source (its REST paths from
``proto/src/determined/api/v1/api.proto`` ~l.1339-1405, served by grpc-gateway):

- ``GET /info``: the version the CLI compares with its own (``harness/determined/cli/version.py``).
- ``POST /api/v1/auth/login``: a token for any user whose password matches, hashed or not.
- ``GET /api/v1/templates/{name}``: ``master/internal/templates/api.go`` ``GetTemplate`` ~l.72-102:
  NotFound (HTTP 404) when no row has that name.
- ``POST /api/v1/templates/{name}``: ``PostTemplate`` ~l.167-204 is a plain INSERT; the
  ``templates`` table's primary key is ``name``
  (``master/static/migrations/20200401000000_initial.tx.up.sql`` l.394, l.644), so a second create
  of a name fails with the database's unique violation, which no error mapping turns into
  anything but codes.Unknown (HTTP 500).
- ``PATCH /api/v1/templates/{name}``: ``PatchTemplateConfig`` ~l.248-285 replaces the config;
  NotFound when there is no such template.
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

VERSION = "0.38.1"


class TemplateMaster:
    """The stand-in master, serving on 127.0.0.1 in a thread; ``templates`` is its table."""

    def __init__(self, password: str) -> None:
        self.password = password
        self.templates: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        master = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict[str, Any]:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}")

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") != "Bearer standin-token":
                    self._send(401, {"code": 16, "message": "unauthenticated", "details": []})
                    return False
                return True

            def _error(self, code: int, grpc: int, message: str) -> None:
                self._send(code, {"code": grpc, "message": message, "details": []})

            def _template(self) -> str:
                return self.path.split("?")[0].removeprefix("/api/v1/templates/")

            def do_GET(self) -> None:  # noqa: N802
                master.requests.append(("GET", self.path))
                if self.path == "/info":
                    return self._send(200, {"version": VERSION, "master_id": "standin",
                                            "cluster_id": "standin", "cluster_name": "standin"})
                if not self._authorized():
                    return None
                if self.path == "/api/v1/me":
                    return self._send(200, {"user": {"id": 1, "username": "admin", "admin": True,
                                                     "active": True}})
                name = self._template()
                if name not in master.templates:
                    # api.NotFoundErrs("template", name, true)
                    return self._error(404, 5, f"template not found: {name}")
                return self._send(200, {"template": master.templates[name]})

            def do_POST(self) -> None:  # noqa: N802
                master.requests.append(("POST", self.path))
                if self.path == "/api/v1/auth/login":
                    body = self._body()
                    from determined.common.api import salt_and_hash

                    # master/internal/api_auth.go l.53: a hashed password (the det CLI's) or a plain one
                    expected = salt_and_hash(master.password) if body.get("isHashed") else master.password
                    if body.get("password") != expected:
                        return self._error(403, 7, "invalid credentials")
                    return self._send(200, {"token": "standin-token", "user": {
                        "id": 1, "username": body.get("username"), "admin": True, "active": True}})
                if not self._authorized():
                    return None
                name, body = self._template(), self._body()
                if name in master.templates:
                    return self._error(500, 2, f"failed to create template {name}: ERROR: duplicate key value "
                                       f'violates unique constraint "templates_pkey" (SQLSTATE=23505)')
                master.templates[name] = {"name": name, "config": body.get("config") or {},
                                          "workspaceId": body.get("workspaceId") or 1}
                return self._send(200, {"template": master.templates[name]})

            def do_PATCH(self) -> None:  # noqa: N802
                master.requests.append(("PATCH", self.path))
                if not self._authorized():
                    return None
                name = self._template()
                if name not in master.templates:
                    return self._error(404, 5, f"template not found: {name}")
                master.templates[name] = {**master.templates[name], "config": self._body()}
                return self._send(200, {"template": master.templates[name]})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
