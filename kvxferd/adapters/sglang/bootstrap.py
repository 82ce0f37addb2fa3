"""The prefill side's bootstrap server: where decode learns which kvxferd instance and daemon
serve a prefill deployment.

SGLang starts one bootstrap server per prefill deployment (``--disaggregation-bootstrap-port``)
and a decode rank knows only ``bootstrap_host:bootstrap_port`` and the request's
``bootstrap_room``. Prefill ranks PUT their kvxferd instance name and their daemon's peer
address here; decode GETs it once per prefill deployment. ``bootstrap_room`` is the kvxferd
request id on both sides. Everything else (geometry, plan, pages) travels between the daemons.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATH = "/kvxferd/prefill"
MAX_BODY = 64 * 1024
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

    def do_PUT(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        if self.path != PATH or not 0 < length <= MAX_BODY:
            self._answer(400, {"error": "PUT a JSON body to " + PATH})
            return
        try:
            body = json.loads(self.rfile.read(length))
            info = {"instance": str(body["instance"]), "daemon_address": str(body["daemon_address"])}
            split_host_port(info["daemon_address"])
        except (ValueError, KeyError, TypeError) as exc:
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
        self.info: dict[str, str] | None = None


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


def put_route(bootstrap_addr: str, instance: str, daemon_address: str, timeout: float = 5.0) -> dict[str, Any]:
    body = json.dumps({"instance": instance, "daemon_address": daemon_address}).encode()
    req = urllib.request.Request(f"http://{bootstrap_addr}{PATH}", data=body, method="PUT",
                                 headers={"Content-Type": "application/json"})
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
