"""The operator HTTP endpoint: ``/metrics``, ``/healthz`` (alive), ``/readyz`` (serving).

Each connection is served on a thread of its own, so the port bounds both: at most
``max_connections`` at once (more are closed at once, unanswered), and each has ``timeout_s``
for its whole request and answer, headers and body (a client that sends half a request, or a
byte every few seconds, is closed then: a socket timeout alone bounds only one ``recv``).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from ..wire.auth import RefusalBook

log = logging.getLogger("kvxferd.http")

#: why a connection was closed unserved (a bounded metric label each)
MAX_CONNECTIONS = "max_connections"
TIMEOUT = "timeout"


class _Guarded(ThreadingHTTPServer):
    """A threading HTTP server with a cap on live connections and a deadline for each."""

    daemon_threads = True
    request_queue_size = 128  # a burst of connections waits to be accepted (and refused at once past the cap)
    max_connections = 16
    timeout_s = 10.0
    on_refused: Callable[[str], None] | None = None
    on_accept_error: Callable[[], None] | None = None

    def server_activate(self) -> None:
        self._live: dict[Any, float] = {}  # connection -> its deadline (time.monotonic)
        self._live_lock = threading.Lock()
        self._refusals = RefusalBook()
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._live_lock:
            full = len(self._live) >= self.max_connections
            if not full:
                self._live[request] = time.monotonic() + self.timeout_s
        if full:
            self._refused(MAX_CONNECTIONS, client_address, f"{self.max_connections} connections already served "
                          "(metrics.max_connections)")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # its thread
        except Exception as exc:  # noqa: BLE001 - e.g. no thread to be had: this connection goes, the port stays
            if self.on_accept_error:
                self.on_accept_error()
            log.warning("event=http_accept_error error=%s msg=%s", type(exc).__name__, json.dumps(str(exc)[:200]))
            self.shutdown_request(request)

    def service_actions(self) -> None:
        """Every turn of the serving loop (``poll_interval``): connections past their deadline are cut."""
        now = time.monotonic()
        with self._live_lock:
            late = [c for c, deadline in self._live.items() if deadline < now]
            for conn in late:
                self._live[conn] = float("inf")  # cut once; its thread closes it
        for conn in late:
            try:
                peer = conn.getpeername()
            except OSError:
                peer = ("?", 0)
            self._refused(TIMEOUT, peer, f"request and answer not done within {self.timeout_s}s (metrics.timeout_s)")
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def shutdown_request(self, request: Any) -> None:
        with self._live_lock:
            self._live.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away or was cut: nothing to tell the operator

    def live(self) -> int:
        with self._live_lock:
            return len(self._live)

    def _refused(self, reason: str, client_address: Any, message: str) -> None:
        if self.on_refused:
            self.on_refused(reason)
        peer = str(client_address[0]) if client_address else "?"
        record, log_now = self._refusals.note(reason, kind=reason, peer=peer)
        if log_now:
            log.warning("event=http_conn_refused reason=%s peer=%s count=%s msg=%s", reason, peer, record["count"],
                        json.dumps(message))


class _Server6(_Guarded):
    address_family = socket.AF_INET6


class OpsServer:
    def __init__(self, bind: str, registry: CollectorRegistry, ready: Callable[[], bool], *,
                 max_connections: int = 16, timeout_s: float = 10.0,
                 on_refused: Callable[[str], None] | None = None,
                 on_accept_error: Callable[[], None] | None = None) -> None:
        host, _, port = bind.rpartition(":")
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 2 * timeout_s  # one recv: a backstop only, the deadline cuts (and counts) first

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    # the text format, or OpenMetrics when the scraper's Accept header asks for it
                    encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
                    body, code = encoder(registry), 200
                elif path == "/healthz":
                    body, ctype, code = b"ok\n", "text/plain", 200
                elif path == "/readyz":
                    good = outer.ready()
                    body, ctype, code = (b"ready\n", "text/plain", 200) if good else (b"not ready\n", "text/plain", 503)
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.ready = ready
        host = host.strip("[]") or "127.0.0.1"
        server_class = _Server6 if ":" in host else _Guarded
        self.httpd = server_class((host, int(port)), Handler, bind_and_activate=False)
        self.httpd.max_connections = max_connections
        self.httpd.timeout_s = timeout_s
        self.httpd.on_refused = on_refused
        self.httpd.on_accept_error = on_accept_error
        try:
            self.httpd.server_bind()
            self.httpd.server_activate()
        except BaseException:
            self.httpd.server_close()
            raise
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="kvxferd-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
