"""The prefill side's bootstrap server: where decode learns which kvxferd instance and daemon
serve a prefill deployment.

SGLang starts one bootstrap server per prefill deployment (``--disaggregation-bootstrap-port``)
and a decode rank knows only ``bootstrap_host:bootstrap_port`` and the request's
``bootstrap_room``. Prefill ranks PUT their kvxferd instance name and their daemon's peer
address here (the instance's rendezvous daemon when its ranks span several daemons), with the
deployment's DP size and whether a request's DP rank follows its room; decode GETs it once per
prefill deployment. ``bootstrap_room`` is the kvxferd request id on both sides. Everything else
(geometry, plan, pages) travels between the daemons.

With DP ranks that do not follow the room (``--load-balance-method`` other than
``follow_bootstrap_room``) each prefill request's DP rank is posted here and decode queries it:
``/register_dp_rank`` and ``/query_dp_ranks``, the paths and bodies SGLang's own decode code
(``CommonKVReceiver.query_prefill_dp_ranks``) uses.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATH = "/kvxferd/prefill"
REGISTER_DP_PATH = "/register_dp_rank"
QUERY_DP_PATH = "/query_dp_ranks"
MAX_BODY = 64 * 1024
MAX_ROOMS = 1 << 16  # rooms whose DP rank is kept (oldest forgotten first): a bound, not a lease
MAX_QUERY = 4096
WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def reachable_address(daemon_address: str, bootstrap_host: str) -> str:
    """A daemon that advertises a wildcard host is reached at the bootstrap server's host."""
    host, port = split_host_port(daemon_address)
    if host in WILDCARD_HOSTS:
        host = bootstrap_host
    return f"{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, *args: Any) -> None:  # keep SGLang's stderr clean
        pass

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path != PATH:
            self._answer(404, {"error": f"unknown path {self.path}"})
            return
        with self.server.lock:
            info = dict(self.server.info) if self.server.info else None
        if info is None:
            self._answer(503, {"error": "no prefill rank registered yet"})
        else:
            self._answer(200, info)

    def _body(self, path: str) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        if self.path != path or not 0 < length <= MAX_BODY:
            self._answer(400 if self.path == path else 404, {"error": f"send a JSON body to {path}"})
            return None
        try:
            return json.loads(self.rfile.read(length))
        except ValueError as exc:
            self._answer(400, {"error": f"bad JSON: {exc}"})
            return None

    def do_POST(self) -> None:  # noqa: N802
        """SGLang's per-request DP rank registry (a DP deployment not routed by room)."""
        path = self.path if self.path in (REGISTER_DP_PATH, QUERY_DP_PATH) else REGISTER_DP_PATH
        body = self._body(path)
        if body is None:
            return
        try:
            if path == REGISTER_DP_PATH:
                room, rank = int(body["bootstrap_room"]), int(body["dp_rank"])
                with self.server.lock:
                    rooms = self.server.dp_rooms
                    rooms.pop(room, None)
                    rooms[room] = rank
                    while len(rooms) > MAX_ROOMS:
                        del rooms[next(iter(rooms))]
                self._answer(200, {"ok": True})
                return
            wanted = [int(r) for r in body["bootstrap_rooms"]][:MAX_QUERY]
        except (KeyError, TypeError, ValueError) as exc:
            self._answer(400, {"error": f"bad DP rank message: {exc}"})
            return
        with self.server.lock:
            found = {str(r): self.server.dp_rooms[r] for r in wanted if r in self.server.dp_rooms}
        self._answer(200, found)

    def do_PUT(self) -> None:  # noqa: N802
        body = self._body(PATH)
        if body is None:
            return
        try:
            info = {"instance": str(body["instance"]), "daemon_address": str(body["daemon_address"]),
                    "dp_size": int(body.get("dp_size", 1)),
                    "follow_bootstrap_room": bool(body.get("follow_bootstrap_room", True))}
            split_host_port(info["daemon_address"])
            if info["dp_size"] < 1:
                raise ValueError(f"dp_size {info['dp_size']} is below 1")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self._answer(400, {"error": f"bad registration: {exc}"})
            return
        with self.server.lock:
            old = self.server.info
            if old is not None and old != info:
                self._answer(409, {"error": f"this bootstrap server already serves {old}", "have": old})
                return
            self.server.info = info
        self._answer(200, info)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self.lock = threading.Lock()
        self.info: dict[str, Any] | None = None
        self.dp_rooms: dict[int, int] = {}  # bootstrap_room -> prefill DP rank, insertion-ordered


class BootstrapHTTPServer:
    """Serves one prefill deployment's route on a background thread."""

    def __init__(self, host: str, port: int) -> None:
        self._server = _Server((host or "0.0.0.0", int(port)))
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvxferd-sglang-bootstrap",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def put_route(bootstrap_addr: str, instance: str, daemon_address: str, timeout: float = 5.0, *, dp_size: int = 1,
              follow_bootstrap_room: bool = True) -> dict[str, Any]:
    return _send("PUT", f"http://{bootstrap_addr}{PATH}", {
        "instance": instance, "daemon_address": daemon_address, "dp_size": int(dp_size),
        "follow_bootstrap_room": bool(follow_bootstrap_room)}, timeout)


def post_dp_rank(bootstrap_addr: str, bootstrap_room: int, dp_rank: int, timeout: float = 5.0) -> dict[str, Any]:
    """File a request's prefill DP rank with the bootstrap server (SGLang's ``/register_dp_rank``)."""
    return _send("POST", f"http://{bootstrap_addr}{REGISTER_DP_PATH}",
                 {"bootstrap_room": int(bootstrap_room), "dp_rank": int(dp_rank)}, timeout)


def _send(method: str, url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    body = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return {"error": exc.read().decode(errors="replace"), "status": exc.code}


def get_route(bootstrap_addr: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """The route a prefill deployment registered, or None while there is none (or no server)."""
    try:
        with urllib.request.urlopen(f"http://{bootstrap_addr}{PATH}", timeout=timeout) as resp:
            info = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    if not isinstance(info, dict) or "instance" not in info or "daemon_address" not in info:
        return None
    return info
