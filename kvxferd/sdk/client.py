"""Engine-side client: what a prefill or decode rank uses to talk to its local daemon.

Sync::

    from kvxferd.sdk.client import EngineClient
    from kvxferd.sdk.kv_cache import allocate_cpu

    cache = allocate_cpu(geometry)                      # tensors the engine computes into
    with EngineClient() as kv:                          # default socket, like `kvxferd serve`
        rank = kv.register("decode-a", "decode", geometry, cache.descriptors())
        kv.expect(rank, "req-1", source_instance="prefill-a", source_address="10.0.0.1:5557",
                  pages=[3, 9, 4])
        result = kv.wait(rank, "req-1", timeout=30)     # {"state": "done", "aux": b"..."}

The daemon pushes an ``event`` when a request becomes ``done`` or ``failed``, so ``wait``
blocks on the socket instead of polling. :class:`AsyncEngineClient` is the same API for
asyncio engines. One client is not thread-safe; use one per thread.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from typing import Any, Iterable, Mapping, Sequence

import zmq
import zmq.asyncio

from ..errors import KvxferError, RequestError, TransferError
from ..model.geometry import RankGeometry
from ..ops.config import default_socket_path
from ..wire import protocol

TERMINAL = ("done", "failed")
MAX_REPLY = 64 * 1024 * 1024


class DaemonError(KvxferError):
    """The daemon answered with an error; ``code`` and ``field`` are the daemon's."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(str(error.get("message", "error")), field=error.get("field"),
                         code=str(error.get("code", "error")))
        self.error = error


def _pages(pages: Iterable[int]) -> list[int]:
    return [int(p) for p in pages]


def _groups(groups: Mapping[str, Iterable[int] | int] | None) -> dict[str, list[int]] | None:
    """Cache groups' tables: pages per KV group, a state slot (an int or ``[slot]``) per state group."""
    if not groups:
        return None
    return {name: [int(v)] if isinstance(v, int) else _pages(v) for name, v in groups.items()}


class _Base:
    def __init__(self, socket_path: str | None = None, timeout: float = 30.0) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout
        self._seq = itertools.count(1)
        self.events: dict[tuple[str, str], dict[str, Any]] = {}

    def _msg(self, op: str, **fields: Any) -> dict[str, Any]:
        msg = {"op": op, "seq": next(self._seq)}
        msg.update({k: v for k, v in fields.items() if v is not None})
        return msg

    def _take(self, msg: dict[str, Any]) -> None:
        if msg.get("op") == "event":
            self.events[(msg["rank_id"], msg["request_id"])] = msg

    def _batch_msgs(self, calls: Iterable[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
        return [self._msg(op, **fields) for op, fields in calls]

    @staticmethod
    def _outcomes(replies: list[dict[str, Any]], key: str) -> list[Any]:
        return [r[key] if r.get("ok") else DaemonError(r.get("error") or {}) for r in replies]

    # one place that turns an expect or a send into wire fields, for single and batched calls
    @staticmethod
    def _expect_call(rank_id: str, request: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        return "expect", {"rank_id": rank_id, "request_id": request["request_id"],
                          "source_instance": request["source_instance"], "pages": _pages(request["pages"]),
                          "source_address": request.get("source_address"),
                          "num_tokens": request.get("num_tokens"), "start": request.get("start") or None,
                          "source_dp_rank": request.get("source_dp_rank"), "groups": _groups(request.get("groups"))}

    @staticmethod
    def _send_call(rank_id: str, chunk: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        fields = {"rank_id": rank_id, "request_id": chunk["request_id"], "pages": _pages(chunk["pages"]),
                  "start": chunk["start"], "end": chunk["end"], "last": chunk.get("last", True),
                  "aux": chunk.get("aux"), "groups": _groups(chunk.get("groups"))}
        for name in ("qos_class", "budget_ms", "deadline_at"):  # sent only when asked: most take their instance's
            if chunk.get(name) is not None:
                fields[name] = chunk[name]
        return "send", fields

    @staticmethod
    def _check(reply: dict[str, Any]) -> dict[str, Any]:
        if not reply.get("ok"):
            raise DaemonError(reply.get("error") or {})
        return reply

    @staticmethod
    def _register_msg(instance: str, role: str, geometry: RankGeometry | dict[str, Any],
                      regions: Sequence[dict[str, Any]], rendezvous: str | None = None,
                      dp: tuple[int, int] | None = None, integrity: str | None = None) -> dict[str, Any]:
        geo = geometry.to_dict() if isinstance(geometry, RankGeometry) else dict(geometry)
        # the pid lets a daemon on the same host notice an engine that died without a word
        msg = {"instance": instance, "role": role, "geometry": geo, "regions": list(regions), "pid": os.getpid()}
        if rendezvous:  # the instance's ranks span several daemons; this one keeps its directory
            msg["rendezvous"] = rendezvous
        if dp is not None:  # (dp_rank, dp_size): a data-parallel rank, filed as <instance>@dp<dp_rank>
            msg["dp_rank"], msg["dp_size"] = dp
        if integrity and integrity != "off":  # the instance asks for digests; the daemon's mode applies where stricter
            msg["integrity"] = integrity
        return msg


class EngineClient(_Base):
    """Blocking client over a ZeroMQ DEALER on the daemon's ``ipc://`` socket."""

    def __init__(self, socket_path: str | None = None, timeout: float = 30.0) -> None:
        super().__init__(socket_path, timeout)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{self.socket_path}")

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _recv(self, timeout: float) -> dict[str, Any] | None:
        # the daemon answers a batch (and a turn's events) as the parts of one message: every
        # part after the first is already here, so look before paying for a poll
        try:
            raw = self.sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            if not self.sock.poll(max(0, int(timeout * 1000))):
                return None
            raw = self.sock.recv()
        return protocol.decode(raw, MAX_REPLY)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        msg = self._msg(op, **fields)
        self.sock.send(protocol.encode(msg))
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._recv(deadline - time.monotonic())
            if reply is None:
                raise TransferError(f"daemon at {self.socket_path} did not answer {op!r} within {self.timeout}s",
                                    field="socket_path", fix="check `kvxferd status` and the socket path")
            if reply.get("seq") == msg["seq"]:
                return self._check(reply)
            self._take(reply)

    def batch(self, calls: Iterable[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """Several calls in one message each way (the parts of one multipart message), answered in
        order. Each reply is what :meth:`call` would get, errors included as ``ok: false``
        replies rather than raised: one refused call does not hide the others' outcomes."""
        msgs = self._batch_msgs(calls)
        if not msgs:
            return []
        self.sock.send_multipart([protocol.encode(m) for m in msgs])
        index = {m["seq"]: i for i, m in enumerate(msgs)}
        out: list[dict[str, Any]] = [{} for _ in msgs]
        deadline = time.monotonic() + self.timeout
        while index:
            reply = self._recv(deadline - time.monotonic())
            if reply is None:
                raise TransferError(f"daemon at {self.socket_path} did not answer {len(index)} of {len(msgs)} "
                                    f"batched calls within {self.timeout}s", field="socket_path",
                                    fix="check `kvxferd status` and the socket path")
            i = index.pop(reply.get("seq"), None)  # type: ignore[arg-type]
            if i is None:
                self._take(reply)
            else:
                out[i] = reply
        return out

    def expect_many(self, rank_id: str, requests: Iterable[Mapping[str, Any]]) -> list[str | DaemonError]:
        """:meth:`expect` for many requests in one round trip. Each request is a mapping of
        ``expect``'s keyword arguments plus ``request_id``; each outcome is its state or the
        :class:`DaemonError` that refused it."""
        return self._outcomes(self.batch(self._expect_call(rank_id, r) for r in requests), "state")

    def send_many(self, rank_id: str, chunks: Iterable[Mapping[str, Any]]) -> list[str | DaemonError]:
        """:meth:`send` for many chunks (of one or many requests) in one round trip; outcomes as
        for :meth:`expect_many`."""
        return self._outcomes(self.batch(self._send_call(rank_id, c) for c in chunks), "state")

    def send_raw(self, payload: bytes) -> dict[str, Any] | None:
        """Send arbitrary bytes (for tests of the daemon's validation); return the reply."""
        self.sock.send(payload)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._recv(deadline - time.monotonic())
            if reply is None or reply.get("op") != "event":
                return reply
            self._take(reply)

    # -- the API -----------------------------------------------------------------------
    def register(self, instance: str, role: str, geometry: RankGeometry | dict[str, Any],
                 regions: Sequence[dict[str, Any]], rendezvous: str | None = None,
                 dp: tuple[int, int] | None = None, integrity: str | None = None) -> str:
        """``rendezvous``: host:port of the daemon every rank of the instance names (instances whose
        ranks register at several daemons); decode sides name it as the source address.
        ``dp``: ``(dp_rank, dp_size)`` of a data-parallel (DP attention) rank. ``integrity``: "sampled"
        or "full" asks that this rank's transfers be checked against digests even where the daemon's
        ``integrity.mode`` is weaker (the stricter wins)."""
        msg = self._register_msg(instance, role, geometry, regions, rendezvous, dp, integrity)
        return self.call("register", **msg)["rank_id"]

    def unregister(self, rank_id: str) -> None:
        self.call("unregister", rank_id=rank_id)

    def expect(self, rank_id: str, request_id: str, *, source_instance: str, pages: Iterable[int],
               source_address: str | None = None, num_tokens: int | None = None, start: int | None = None,
               source_dp_rank: int | None = None, groups: Mapping[str, Iterable[int] | int] | None = None) -> str:
        """Expect a request's KV into ``pages`` (they cover the request from token 0).

        ``start``: tokens before it are already in those pages (a prefix cache hit); only
        ``[start, num_tokens)`` moves and the request is done once that range arrived.
        ``source_dp_rank``: the DP rank of a data-parallel source instance that holds the request.
        ``groups``: the instance's cache groups, a page table (from token 0) per KV group and
        the state slot per state group.
        """
        op, fields = self._expect_call(rank_id, dict(
            request_id=request_id, source_instance=source_instance, pages=pages, source_address=source_address,
            num_tokens=num_tokens, start=start, source_dp_rank=source_dp_rank, groups=groups))
        return self.call(op, **fields)["state"]

    def send(self, rank_id: str, request_id: str, *, pages: Iterable[int], start: int, end: int,
             last: bool = True, aux: bytes | None = None,
             groups: Mapping[str, Iterable[int] | int] | None = None,
             qos_class: str | None = None, budget_ms: float | None = None,
             deadline_at: float | None = None) -> str:
        """``groups``: the chunk's pages per KV group (as ``pages``), each state group's slot with
        the last chunk. ``qos_class`` ("latency" or "bulk"), and ``budget_ms`` (ms from this call)
        or ``deadline_at`` (``time.time()`` seconds) by which the KV must have landed, or the
        request fails ``deadline`` (both: the earlier): the first chunk's hold for the request;
        None takes the instance's class (``qos.instances``) and no deadline."""
        op, fields = self._send_call(rank_id, dict(request_id=request_id, pages=pages, start=start, end=end,
                                                   last=last, aux=aux, groups=groups, qos_class=qos_class,
                                                   budget_ms=budget_ms, deadline_at=deadline_at))
        return self.call(op, **fields)["state"]

    def poll(self, rank_id: str, request_id: str) -> dict[str, Any]:
        event = self.events.get((rank_id, request_id))
        if event is not None:
            return event
        return self.call("poll", rank_id=rank_id, request_id=request_id)

    def abort(self, rank_id: str, request_id: str, reason: str | None = None) -> str:
        return self.call("abort", rank_id=rank_id, request_id=request_id, reason=reason)["state"]

    def status(self) -> dict[str, Any]:
        return self.call("status")["status"]

    def wait(self, rank_id: str, request_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Block until the request is terminal; returns the final event (state, aux, reason)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        key = (rank_id, request_id)
        state = self.poll(rank_id, request_id)
        if state.get("state") in TERMINAL:
            self.events.pop(key, None)
            return state
        while key not in self.events:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestError(f"request {request_id!r} not finished within the wait timeout",
                                   field="timeout", code="wait_timeout", fix="wait longer or poll")
            reply = self._recv(min(left, 1.0))
            if reply is not None:
                self._take(reply)
        return self.events.pop(key)

    def wait_any(self, timeout: float) -> dict[str, Any] | None:
        """Return the next completion event, or None after ``timeout`` seconds."""
        if self.events:
            key = next(iter(self.events))
            return self.events.pop(key)
        deadline = time.monotonic() + timeout
        while True:
            reply = self._recv(deadline - time.monotonic())
            if reply is None:
                return None
            if reply.get("op") == "event":
                return reply


class AsyncEngineClient(_Base):
    """The same API for engines that run an asyncio loop."""

    def __init__(self, socket_path: str | None = None, timeout: float = 30.0) -> None:
        super().__init__(socket_path, timeout)
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{self.socket_path}")
        self._waiters: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            try:
                reply = protocol.decode(await self.sock.recv(), MAX_REPLY)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if reply.get("op") == "event":
                key = (reply["rank_id"], reply["request_id"])
                fut = self._waiters.pop(key, None)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
                else:
                    self.events[key] = reply
                continue
            fut = self._waiters.pop(reply.get("seq"), None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self._ensure_reader()
        msg = self._msg(op, **fields)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[msg["seq"]] = fut
        await self.sock.send(protocol.encode(msg))
        try:
            return self._check(await asyncio.wait_for(fut, self.timeout))
        except asyncio.TimeoutError:
            raise TransferError(f"daemon at {self.socket_path} did not answer {op!r} within {self.timeout}s",
                                field="socket_path", fix="check `kvxferd status`") from None
        finally:
            self._waiters.pop(msg["seq"], None)

    async def batch(self, calls: Iterable[tuple[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
        """As :meth:`EngineClient.batch`."""
        self._ensure_reader()
        msgs = self._batch_msgs(calls)
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in msgs]
        for m, fut in zip(msgs, futs):
            self._waiters[m["seq"]] = fut
        try:
            if msgs:
                await self.sock.send_multipart([protocol.encode(m) for m in msgs])
            return list(await asyncio.wait_for(asyncio.gather(*futs), self.timeout))
        except asyncio.TimeoutError:
            raise TransferError(f"daemon at {self.socket_path} did not answer {len(msgs)} batched calls within "
                                f"{self.timeout}s", field="socket_path", fix="check `kvxferd status`") from None
        finally:
            for m in msgs:
                self._waiters.pop(m["seq"], None)

    async def expect_many(self, rank_id: str, requests: Iterable[Mapping[str, Any]]) -> list[str | DaemonError]:
        return self._outcomes(await self.batch(self._expect_call(rank_id, r) for r in requests), "state")

    async def send_many(self, rank_id: str, chunks: Iterable[Mapping[str, Any]]) -> list[str | DaemonError]:
        return self._outcomes(await self.batch(self._send_call(rank_id, c) for c in chunks), "state")

    async def register(self, instance: str, role: str, geometry: RankGeometry | dict[str, Any],
                       regions: Sequence[dict[str, Any]], rendezvous: str | None = None,
                       dp: tuple[int, int] | None = None, integrity: str | None = None) -> str:
        msg = self._register_msg(instance, role, geometry, regions, rendezvous, dp, integrity)
        return (await self.call("register", **msg))["rank_id"]

    async def expect(self, rank_id: str, request_id: str, *, source_instance: str, pages: Iterable[int],
                     source_address: str | None = None, num_tokens: int | None = None,
                     start: int | None = None, source_dp_rank: int | None = None,
                     groups: Mapping[str, Iterable[int] | int] | None = None) -> str:
        op, fields = self._expect_call(rank_id, dict(
            request_id=request_id, source_instance=source_instance, pages=pages, source_address=source_address,
            num_tokens=num_tokens, start=start, source_dp_rank=source_dp_rank, groups=groups))
        return (await self.call(op, **fields))["state"]

    async def send(self, rank_id: str, request_id: str, *, pages: Iterable[int], start: int, end: int,
                   last: bool = True, aux: bytes | None = None,
                   groups: Mapping[str, Iterable[int] | int] | None = None,
                   qos_class: str | None = None, budget_ms: float | None = None,
                   deadline_at: float | None = None) -> str:
        op, fields = self._send_call(rank_id, dict(request_id=request_id, pages=pages, start=start, end=end,
                                                   last=last, aux=aux, groups=groups, qos_class=qos_class,
                                                   budget_ms=budget_ms, deadline_at=deadline_at))
        return (await self.call(op, **fields))["state"]

    async def poll(self, rank_id: str, request_id: str) -> dict[str, Any]:
        event = self.events.get((rank_id, request_id))
        return event if event is not None else await self.call("poll", rank_id=rank_id, request_id=request_id)

    async def abort(self, rank_id: str, request_id: str, reason: str | None = None) -> str:
        return (await self.call("abort", rank_id=rank_id, request_id=request_id, reason=reason))["state"]

    async def status(self) -> dict[str, Any]:
        return (await self.call("status"))["status"]

    async def wait(self, rank_id: str, request_id: str, timeout: float | None = None) -> dict[str, Any]:
        key = (rank_id, request_id)
        self._ensure_reader()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[key] = fut
        try:
            state = await self.poll(rank_id, request_id)
            if state.get("state") in TERMINAL:
                self.events.pop(key, None)
                return state
            if key in self.events:
                return self.events.pop(key)
            return await asyncio.wait_for(fut, self.timeout if timeout is None else timeout)
        finally:
            self._waiters.pop(key, None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(0)
