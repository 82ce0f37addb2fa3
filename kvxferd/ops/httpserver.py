"""The operator HTTP endpoint: ``/metrics``, ``/healthz`` (alive), ``/readyz`` (serving)."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class OpsServer:
    def __init__(self, bind: str, registry: CollectorRegistry, ready: Callable[[], bool]) -> None:
        host, _, port = bind.rpartition(":")
        outer = self

        class Handler(BaseHTTPRequestHandler):
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
        server_class = _Server6 if ":" in host else ThreadingHTTPServer
        self.httpd = server_class((host, int(port)), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="kvxferd-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
