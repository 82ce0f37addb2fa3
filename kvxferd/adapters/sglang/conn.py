"""The per-request classes SGLang builds for ``--disaggregation-transfer-backend kvxferd`` (sglang 0.5.23).

A request's ``bootstrap_room`` is its kvxferd request id on both sides; every call goes
through the rank's :class:`~.manager.KvxferdKVManager` to the local daemon.

- prefill: :class:`KvxferdKVSender` polls the daemon (``Bootstrapping`` until the decode
  side's expect reached it, then ``WaitingForInput``), and each ``send`` of SGLang's
  chunked prefill is one kvxferd ``send`` of the chunk's pages and token range; the last
  one carries the request's MetadataBuffers row as ``aux``.
- decode: :class:`KvxferdKVReceiver` learns the prefill deployment's kvxferd instance and
  daemon address from the prefill bootstrap server, turns ``send_metadata`` into
  ``expect`` (``decode_prefix_len`` becomes ``start``: only the suffix moves), and answers
  ``Success`` only after the aux row was written into its own MetadataBuffers.
- DP attention: each DP rank's ranks register as that DP rank of the instance, and a
  decode ``expect`` names SGLang's ``prefill_dp_rank`` as ``source_dp_rank`` (see
  :mod:`.topology`); ranks on several nodes name the instance's rendezvous daemon.

Failures carry kvxferd's code and reason into SGLang's ``KVTransferError``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError

from ...errors import KvxferError, RegistrationError
from . import polling
from .bootstrap import BootstrapHTTPServer, post_dp_rank
from .layout import chunk_window, expect_pages
from .manager import KvxferdKVManager, PrefillInfo, log

__all__ = ["KvxferdKVBootstrapServer", "KvxferdKVManager", "KvxferdKVReceiver", "KvxferdKVSender"]


class _Conclusion:
    """Shared bookkeeping of a request's end state on one rank."""

    def __init__(self, mgr: KvxferdKVManager, bootstrap_addr: str, bootstrap_room: Any) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.request_id = str(bootstrap_room)  # the kvxferd request id on both sides
        self.aux_index: int | None = None
        self.conclude_state: Optional[int] = None
        self.failure: tuple[str, str] | None = None

    def _conclude(self, poll: int, record: dict[str, Any] | None = None) -> int:
        if poll == KVPoll.Failed and self.failure is None:
            record = record or {}
            self.failure = (str(record.get("code", "unknown")), str(record.get("reason", "")))
        if poll in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = poll
            self.kv_mgr.forget(self.request_id)
        return poll

    def _fail_local(self, code: str, reason: str) -> None:
        self.failure = (code, reason)
        self.conclude_state = KVPoll.Failed
        log.warning("event=sglang_request_failed request_id=%s code=%s reason=%r", self.request_id, code, reason)

    def failure_exception(self) -> None:
        code, reason = self.failure or ("unknown", "the transfer did not finish")
        raise KVTransferError(self.bootstrap_room, f"kvxferd request {self.request_id} failed: code={code} "
                                                   f"reason={reason}")

    def clear(self) -> None:
        """SGLang is done with the request: drop any completion event still held for it."""
        self.kv_mgr.forget(self.request_id)

    def _abort(self, reason: str) -> None:
        if self.conclude_state is not None:
            return
        try:
            self.kv_mgr.call("abort", self.request_id, reason)
        except KvxferError:
            pass  # unknown there: nothing in flight for it
        self._fail_local("aborted", reason)


class KvxferdKVSender(_Conclusion, BaseKVSender):
    """A prefill rank's side of one request."""

    def __init__(self, mgr: KvxferdKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self._file_dp_rank(req_has_disagg_prefill_dp_rank)
        self.num_pages: int | None = None
        self.cursor = 0
        self.pages_sent = 0
        self.sent = False
        # an instance with sliding-window layers sends the whole request with its last chunk:
        # SGLang names the window's SWA pages only then, and the window may reach into earlier chunks
        self.held: list[int] = []
        #: the request's SGLang priority (the plugin's hook on PrefillBootstrapQueue._process_req
        #: sets it): its first chunk asks the transfer class the manager maps it to
        self.priority: int | None = None

    def _file_dp_rank(self, routed: bool) -> None:
        """Let decode find this request's DP rank, as SGLang's own senders do: with the room as the
        rule (``follow_bootstrap_room``) a request on another DP rank is refused at once (decode
        would expect it there); otherwise its DP rank is posted to the bootstrap server. A request
        routed to a DP rank by the router (``disagg_prefill_dp_rank``) tells decode itself."""
        mgr = self.kv_mgr
        if mgr.dp is None or routed:
            return
        dp_rank, dp_size = mgr.dp
        if mgr.follow_bootstrap_room:
            implied = int(self.bootstrap_room) % dp_size
            if implied != dp_rank:
                self._fail_local("dp_rank", f"bootstrap_room {self.bootstrap_room} implies prefill DP rank {implied} "
                                            f"(room % dp_size {dp_size}), but it runs on DP rank {dp_rank}; set "
                                            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 or another "
                                            "--load-balance-method to route by query")
            return
        try:
            answer = post_dp_rank(mgr.bootstrap_address(), int(self.bootstrap_room), dp_rank)
        except OSError as exc:
            answer = {"error": str(exc)}
        if "error" in answer:
            self._fail_local("bootstrap", f"could not file prefill DP rank {dp_rank} of bootstrap_room "
                                          f"{self.bootstrap_room} with {mgr.bootstrap_address()}: {answer['error']}")

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        self.num_pages = int(num_kv_indices)
        self.aux_index = aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # an empty last chunk still carries the aux row and ends the request
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: Any, state_indices: Optional[list] = None, num_kv_tokens: Optional[int] = None,
             **_: Any) -> None:
        if self.conclude_state is not None:
            return
        # sglang 0.5.23 passes state_indices (a list, empty without state) on the last send only
        last = state_indices is not None
        pages = [int(p) for p in kv_indices]
        chunk_pages = len(pages)
        try:
            start, end = chunk_window(self.cursor, num_kv_tokens, len(pages), self.kv_mgr.facts.page_size)
            if self.num_pages is not None and self.pages_sent + len(pages) > self.num_pages:
                raise RegistrationError(f"{self.pages_sent + len(pages)} pages sent, init announced {self.num_pages}",
                                        field="kv_indices", fix="send each page of the request once")
            if self.kv_mgr.window is not None:
                if not last:  # held back: nothing is read from these pages before the last chunk
                    self.held += pages
                    self.cursor = end
                    self.pages_sent += chunk_pages
                    return
                pages, start = self.held + pages, 0
            aux = self.kv_mgr.read_aux(self.aux_index) if last and self.aux_index is not None else None
            groups = self.kv_mgr.request_groups(pages, state_indices, with_state=last)
            qos_class = self.kv_mgr.qos_class(self.priority) if not self.sent else None
            self.kv_mgr.call("send", self.request_id, pages=pages, start=start, end=end, last=last, aux=aux,
                             **({"groups": groups} if groups else {}), **({"qos_class": qos_class} if qos_class else {}))
        except KvxferError as exc:
            self._fail_local(exc.code, str(exc))
            return
        self.cursor = end
        self.pages_sent += chunk_pages
        self.sent = True

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        try:
            record = self.kv_mgr.state(self.request_id)
        except KvxferError as exc:
            self._fail_local(exc.code, str(exc))
            return KVPoll.Failed
        state = None if record is None else record.get("state")
        return self._conclude(polling.sender_poll(state, sent=self.sent), record)

    def poll_pp_consensus(self) -> int:
        return self.poll()

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric()

    def abort(self) -> None:
        self._abort("aborted by the prefill engine")


class KvxferdKVReceiver(_Conclusion, BaseKVReceiver):
    """A decode rank's side of one request."""

    def __init__(self, mgr: KvxferdKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.route: PrefillInfo | None = None
        self.prefill_dp_rank: int | None = None
        self.metadata_sent = False
        self.aux_landed = False
        # members SGLang's decode scheduler reads outside the base class
        self.require_staging = False
        self.abort_notified = False
        self.bootstrap_infos: list = []
        self.init_time: float | None = None
        self.prompt_len: int | None = None  # set by the plugin's hook before send_metadata

    def init(self, prefill_dp_rank: int) -> None:
        mgr = self.kv_mgr
        if not mgr.try_ensure_parallel_info(self.bootstrap_addr):
            self._fail_local("bootstrap", f"no kvxferd route at bootstrap server {self.bootstrap_addr}")
            return
        self.route = mgr.prefill_info_table[self.bootstrap_addr]
        # SGLang resolved it (router, room or bootstrap query); a deployment without DP ranks has only 0
        self.prefill_dp_rank = int(prefill_dp_rank) if self.route.dp_size > 1 else None
        self.init_time = time.monotonic()

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Optional[list] = None,
                      decode_prefix_len: Optional[int] = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE, **_: Any) -> None:
        if self.conclude_state is not None:
            return
        if self.route is None:
            self._fail_local("bootstrap", "send_metadata before init found the prefill route")
            return
        if destination != KVTransferDestination.DEVICE:
            self._fail_local("registration", f"destination {destination} is not supported; kvxferd writes "
                                             "the registered pool only")
            return
        start = int(decode_prefix_len or 0)
        try:
            pages = expect_pages(kv_indices, start, self.kv_mgr.facts.page_size)
            groups = self.kv_mgr.request_groups(pages, state_indices, with_state=True)
            extra: dict[str, Any] = {"groups": groups} if groups else {}
            if self.kv_mgr.window is not None:
                if self.prompt_len is None:
                    raise RegistrationError(
                        "num_tokens (the prompt's length) did not reach the receiver; a sliding-window group "
                        "needs it to find its window",
                        field="num_tokens", fix="load the kvxferd plugin (its hook on "
                                                "DecodePreallocQueue._send_kv_metadata hands it over)")
                extra["num_tokens"] = self.prompt_len
            self.kv_mgr.call("expect", self.request_id, source_instance=self.route.instance,
                             source_address=self.route.daemon_address, pages=pages, start=start or None,
                             source_dp_rank=self.prefill_dp_rank, **extra)
        except KvxferError as exc:
            self._fail_local(exc.code, str(exc))
            return
        self.aux_index = aux_index
        self.metadata_sent = True

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        record = None
        if self.route is not None and self.metadata_sent:
            try:
                record = self.kv_mgr.state(self.request_id)
            except KvxferError as exc:
                self._fail_local(exc.code, str(exc))
                return KVPoll.Failed
        state = None if record is None else record.get("state")
        if state == "done" and not self.aux_landed:
            aux = record.get("aux")
            try:
                if self.aux_index is not None:
                    self.kv_mgr.write_aux(self.aux_index, bytes(aux or b""))
            except KvxferError as exc:
                self._fail_local(exc.code, str(exc))
                return KVPoll.Failed
            self.aux_landed = True
        return self._conclude(polling.receiver_poll(state, inited=self.route is not None,
                                                    metadata_sent=self.metadata_sent,
                                                    aux_landed=self.aux_landed), record)

    def abort(self) -> None:
        self._abort("aborted by the decode engine")

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tell the daemons (and so the prefill side) that this request is over.

        ``abort_notified`` stays False: kvxferd reports a failure to the engine only once no
        data thread writes the request's pages, so SGLang may release them at once.
        """
        if self.metadata_sent:
            self._abort("decode released the request")


class KvxferdKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill deployment's bootstrap server (see :mod:`.bootstrap`)."""

    def __init__(self, host: str, port: int) -> None:
        self.server = BootstrapHTTPServer(host, port)
        self.port = self.server.port

    def close(self) -> None:
        self.server.close()
