"""A small blocking client of etcd's v3 API as JSON over HTTP (the gRPC gateway etcd serves on its
client port): put, range over a prefix, delete, and leases. No dependency beyond the standard
library, so the default (embedded) directory never needs it.

With a user name, the client authenticates (``/v3/auth/authenticate``) and sends the token it
gets in the ``Authorization`` header of every call; a token etcd no longer takes (expired, or
the member restarted) is replaced once per call. ``https://`` endpoints are checked against a CA
file (or the system's), with a client certificate where etcd asks for one.

Every call has a timeout and a bound on the answer it reads; a failure raises
:class:`EtcdUnreachable` (no endpoint answered: it names each endpoint and why) or
:class:`EtcdError` (an endpoint answered with an error). Calls block: the daemon runs them in a
thread of its own, never on its event loop.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import KvxferError

#: the largest answer read from etcd (a range over one instance's ranks is far smaller)
MAX_ANSWER = 8 << 20


class EtcdError(KvxferError):
    """etcd answered, with an error (a lease it no longer knows, a request it refused)."""

    code = "etcd"

    def __init__(self, message: str, *, endpoint: str, status: int = 0, grpc_code: int = 0) -> None:
        self.endpoint = endpoint
        self.status = status
        self.grpc_code = grpc_code
        super().__init__(message, field="directory.etcd_endpoints")


class EtcdUnreachable(EtcdError):
    """No endpoint answered in time."""

    code = "directory_unreachable"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


@dataclass(frozen=True)
class Endpoint:
    url: str
    host: str
    port: int
    https: bool


def parse_endpoint(url: str) -> Endpoint:
    """``http://host:port`` (or https); raises ValueError saying what is wrong."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not http://host:port")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} has a path; name only http://host:port")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 2379)
    except ValueError:
        raise ValueError(f"{url!r} has a bad port") from None
    return Endpoint(url.rstrip("/"), parts.hostname, port, parts.scheme == "https")


class DirectorySettings(Protocol):
    """The settings a client is made from (``[directory]``, :class:`kvxferd.ops.config.DirectorySection`)."""

    etcd_endpoints: list[str]
    etcd_timeout_s: float
    etcd_username: str
    etcd_password_file: str
    etcd_ca_file: str
    etcd_cert_file: str
    etcd_key_file: str


@dataclass(frozen=True)
class Credentials:
    """An etcd user (``etcdctl user add``) and its password."""

    username: str
    password: str


def read_password(path: str) -> str:
    """The password in ``path`` (its first line, without the line end); raises ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            password = fh.readline().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"cannot read the etcd password file {path}: {exc.strerror}") from None
    if not password:
        raise ValueError(f"the etcd password file {path} is empty")
    return password


def tls_context(ca_file: str = "", cert_file: str = "", key_file: str = "") -> ssl.SSLContext:
    """What ``https://`` endpoints are checked with: the CA file (else the system's CAs), and the
    client certificate and key where given."""
    context = ssl.create_default_context(cafile=ca_file or None)
    if cert_file:
        context.load_cert_chain(cert_file, key_file or None)
    return context


def _auth_refused(exc: EtcdError) -> bool:
    """etcd did not take the token (expired, unknown to a restarted member)."""
    text = str(exc).lower()
    return exc.grpc_code == 16 or exc.status == 401 or "auth token" in text


class EtcdClient:
    """Blocking calls to the first endpoint that answers (it stays the first choice while it does).

    One connection per endpoint is kept open between calls (a daemon calls every heartbeat); a
    kept connection that fails is dropped and the call tried once on a fresh one. Not for
    several threads at once: a daemon calls from one thread of its own."""

    def __init__(self, endpoints: list[str], timeout_s: float = 2.0, max_answer: int = MAX_ANSWER, *,
                 credentials: Credentials | None = None, tls: ssl.SSLContext | None = None) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = [parse_endpoint(e) for e in endpoints]
        self.timeout_s = timeout_s
        self.max_answer = max_answer
        self.last_endpoint = self.endpoints[0].url
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self.credentials = credentials
        self.tls = tls  # https:// endpoints; None: the system's CAs
        #: the token of each endpoint (a simple token is known only to the member that issued it)
        self._tokens: dict[str, str] = {}

    @classmethod
    def from_config(cls, d: DirectorySettings) -> "EtcdClient":
        """The client ``[directory]`` describes; raises ValueError naming a file it cannot read."""
        credentials = Credentials(d.etcd_username, read_password(d.etcd_password_file)) if d.etcd_username else None
        tls = (tls_context(d.etcd_ca_file, d.etcd_cert_file, d.etcd_key_file)
               if any(e.startswith("https://") for e in d.etcd_endpoints) else None)
        return cls(list(d.etcd_endpoints), d.etcd_timeout_s, credentials=credentials, tls=tls)

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    # -- the calls ---------------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        self.call("/v3/kv/put", body)

    def get_prefix(self, prefix: bytes, limit: int = 0) -> list[tuple[bytes, bytes, int]]:
        """(key, value, lease) of every key under ``prefix``, in key order."""
        body: dict[str, Any] = {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}
        if limit:
            body["limit"] = str(limit)
        answer = self.call("/v3/kv/range", body)
        return [(unb64(kv["key"]), unb64(kv.get("value", "")), int(kv.get("lease", 0)))
                for kv in answer.get("kvs") or []]

    def delete(self, key: bytes) -> int:
        return int(self.call("/v3/kv/deleterange", {"key": b64(key)}).get("deleted", 0))

    def grant(self, ttl_s: int) -> int:
        answer = self.call("/v3/lease/grant", {"TTL": str(ttl_s)})
        if answer.get("error"):
            raise EtcdError(f"etcd {self.last_endpoint} refused a lease: {answer['error']}",
                            endpoint=self.last_endpoint)
        return int(answer["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's renewed TTL; 0 when etcd no longer knows it (it expired: grant a new one)."""
        answer = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        result = answer.get("result") if isinstance(answer.get("result"), dict) else answer
        return int(result.get("TTL", 0))

    def revoke(self, lease: int) -> None:
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as exc:
            if exc.grpc_code != 5:  # NotFound: expired already, which is what revoking wanted
                raise

    # -- transport ---------------------------------------------------------------------------------
    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        failures: list[str] = []
        order = sorted(self.endpoints, key=lambda e: e.url != self.last_endpoint)
        for endpoint in order:
            try:
                answer = self._post(endpoint, path, body)
            except (OSError, http.client.HTTPException) as exc:
                failures.append(f"{endpoint.url}: {type(exc).__name__}: {exc}"[:200])
                continue
            self.last_endpoint = endpoint.url
            return answer
        raise EtcdUnreachable(f"no etcd endpoint answered {path} ({'; '.join(failures)})",
                              endpoint=",".join(e.url for e in self.endpoints))

    def _exchange(self, endpoint: Endpoint, path: str, body: dict[str, Any],
                  token: str | None = None) -> tuple[int, bytes]:
        kept = endpoint.url in self._conns
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        for attempt in (0, 1):
            conn = self._conns.pop(endpoint.url, None)
            if conn is None:
                if endpoint.https:
                    conn = http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=self.timeout_s,
                                                       context=self.tls or tls_context())
                else:
                    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=self.timeout_s)
            try:
                conn.request("POST", path, json.dumps(body), headers)
                response = conn.getresponse()
                raw = response.read(self.max_answer + 1)
            except (OSError, http.client.HTTPException):
                conn.close()
                if kept and attempt == 0:
                    continue  # the kept connection had gone stale (etcd closed it): once more, fresh
                raise
            if len(raw) > self.max_answer or response.will_close or not response.isclosed():
                conn.close()  # a half-read answer leaves the connection unusable
            else:
                self._conns[endpoint.url] = conn
            return response.status, raw
        raise AssertionError("unreachable")

    def _post(self, endpoint: Endpoint, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.credentials is None:
            return self._answer(endpoint, path, *self._exchange(endpoint, path, body))
        for attempt in (0, 1):
            token = self._token(endpoint)
            try:
                return self._answer(endpoint, path, *self._exchange(endpoint, path, body, token))
            except EtcdError as exc:
                if attempt or not _auth_refused(exc):
                    raise
                self._tokens.pop(endpoint.url, None)  # expired: authenticate again, once
        raise AssertionError("unreachable")

    def _token(self, endpoint: Endpoint) -> str:
        token = self._tokens.get(endpoint.url)
        if token is not None:
            return token
        assert self.credentials is not None
        body = {"name": self.credentials.username, "password": self.credentials.password}
        try:
            answer = self._answer(endpoint, "/v3/auth/authenticate", *self._exchange(
                endpoint, "/v3/auth/authenticate", body))
        except EtcdUnreachable:
            raise
        except EtcdError as exc:
            raise EtcdError(f"etcd {endpoint.url} refused user {self.credentials.username!r}: {exc}; fix: check "
                            "directory.etcd_username and directory.etcd_password_file (etcdctl user get)"[:500],
                            endpoint=endpoint.url, status=exc.status, grpc_code=exc.grpc_code) from None
        token = answer.get("token")
        if not isinstance(token, str) or not token:
            raise EtcdError(f"etcd {endpoint.url} authenticated user {self.credentials.username!r} but gave no "
                            "token", endpoint=endpoint.url)
        self._tokens[endpoint.url] = token
        return token

    def _answer(self, endpoint: Endpoint, path: str, status: int, raw: bytes) -> dict[str, Any]:
        if len(raw) > self.max_answer:
            raise EtcdError(f"etcd {endpoint.url} answered {path} with more than {self.max_answer} bytes",
                            endpoint=endpoint.url, status=status)
        try:
            # a streamed call (keepalive) answers one JSON object per line; the first is ours
            answer = json.loads(raw.split(b"\n", 1)[0] or b"{}")
        except ValueError:
            raise EtcdError(f"etcd {endpoint.url} answered {path} with no JSON (HTTP {status}): "
                            f"{raw[:100]!r}", endpoint=endpoint.url, status=status) from None
        if not isinstance(answer, dict):
            raise EtcdError(f"etcd {endpoint.url} answered {path} with {type(answer).__name__}",
                            endpoint=endpoint.url, status=status)
        error = answer.get("error")
        if status != 200 or (isinstance(error, dict) and error) or isinstance(error, str):
            detail = error if isinstance(error, (str, dict)) else answer.get("message", "")
            code = answer.get("code", error.get("grpc_code", 0) if isinstance(error, dict) else 0)
            raise EtcdError(f"etcd {endpoint.url} refused {path} (HTTP {status}): {detail}"[:400],
                            endpoint=endpoint.url, status=status, grpc_code=int(code or 0))
        return answer
