"""The vLLM connector's pure logic: settings, transfer params, page math, request bookkeeping.

Nothing here imports vLLM or talks to a daemon, so every rule the connector follows can be
tested on its own. ``connector.py`` feeds it what vLLM hands the connector and turns its
answers into daemon calls.

Identity: request ids differ between the prefill and the decode engine (offline
``LLM.generate`` numbers its own), so a transfer is named by a ``transfer_id`` the prefill
scheduler draws, and that id travels to the decode engine inside ``kv_transfer_params``
together with the prefill instance, its daemon's address (its rendezvous's, for an instance
over several daemons) and, for a data-parallel instance, the DP rank that holds the request.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ...errors import ConfigError
from ...model.sampling import MODES

#: key under which kvxferd's part of ``kv_transfer_params`` travels (other connectors keep theirs)
PARAMS_KEY = "kvxferd"
ROLES_BY_KV_ROLE: dict[str, tuple[str, ...]] = {
    "kv_producer": ("prefill",),
    "kv_consumer": ("decode",),
    "kv_both": ("prefill", "decode"),
}
EXTRA_KEYS = ("socket_path", "instance", "address", "rendezvous", "call_timeout_s", "preempt_wait_s", "integrity",
              "latency_priority")
#: what names kvxferd's connector to vLLM (vLLM imports ``kv_connector`` from the module path)
CONNECTOR = {"kv_connector": "KvxferdConnector", "kv_connector_module_path": "kvxferd.adapters.vllm"}


def kv_transfer_config(kv_role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for kvxferd's connector, ``extra`` its ``kv_connector_extra_config``
    (passed as given: the connector checks the keys when vLLM builds it, see :data:`EXTRA_KEYS`)."""
    return {**CONNECTOR, "kv_role": kv_role, "kv_connector_extra_config": extra}


# -- settings ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` says, checked once when the connector is built."""

    instance: str
    roles: tuple[str, ...]
    socket_path: str | None = None
    address: str | None = None
    call_timeout_s: float = 30.0
    preempt_wait_s: float = 60.0
    #: host:port of the instance's rendezvous daemon (ranks over several daemons); decode's source address
    rendezvous: str | None = None
    #: (dp_rank, dp_size) of a data-parallel rank (see :func:`dp_of`)
    dp: tuple[int, int] | None = None
    #: the integrity mode this instance asks its daemon for ("sampled", "full"; the daemon's own
    #: ``integrity.mode`` applies where stricter): a failed check reaches vLLM as load errors
    integrity: str | None = None
    #: a request whose vLLM ``priority`` is at most this (vLLM: lower is more urgent) asks its
    #: daemon for the latency class, any other the bulk class (None: it asks none, and takes its
    #: instance's class from the daemon's ``qos.instances``)
    latency_priority: int | None = None

    def qos_class(self, priority: int | None) -> str | None:
        """The transfer class a request of vLLM ``priority`` asks for (None: its instance's)."""
        if self.latency_priority is None or priority is None:
            return None
        return "latency" if priority <= self.latency_priority else "bulk"

    @classmethod
    def from_config(cls, extra: Mapping[str, Any] | None, *, kv_role: str | None,
                    engine_id: str | None, dp: tuple[int, int] | None = None) -> "ConnectorSettings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has unknown key(s) {unknown}",
                              field=f"kv_connector_extra_config.{unknown[0]}",
                              fix=f"use only {list(EXTRA_KEYS)}")
        if kv_role not in ROLES_BY_KV_ROLE:
            raise ConfigError(f"kv_role {kv_role!r} is not one kvxferd serves", field="kv_role",
                              fix=f"set kv_role to one of {sorted(ROLES_BY_KV_ROLE)}")
        instance = extra.get("instance") or (f"vllm-{engine_id}" if engine_id else None)
        for key in ("instance", "socket_path", "address", "rendezvous"):
            value = instance if key == "instance" else extra.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"kv_connector_extra_config.{key} must be a non-empty string, got {value!r}",
                                  field=f"kv_connector_extra_config.{key}", fix=f"give {key} as a string")
        if instance is None:
            raise ConfigError("no instance name: kv_connector_extra_config.instance is unset and vLLM gave no "
                              "engine_id", field="kv_connector_extra_config.instance",
                              fix="set instance to a name shared by every rank of this vLLM instance")
        address, rendezvous = extra.get("address"), extra.get("rendezvous")
        for key, value, fix in (("address", address, "give the control address other daemons reach this node's "
                                                     "daemon at"),
                                ("rendezvous", rendezvous, "give host:control_port of the daemon of the instance's "
                                                           "first rank, the same on every rank")):
            if value is not None:
                host, _, port = value.rpartition(":")
                if not host or not port.isdigit():
                    raise ConfigError(f"kv_connector_extra_config.{key} must be host:port, got {value!r}",
                                      field=f"kv_connector_extra_config.{key}", fix=fix)
        timeouts = {}
        for key in ("call_timeout_s", "preempt_wait_s"):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ConfigError(f"kv_connector_extra_config.{key} must be a positive number, got {value!r}",
                                      field=f"kv_connector_extra_config.{key}", fix=f"set {key} in seconds")
                timeouts[key] = float(value)
        integrity = extra.get("integrity")
        if integrity is not None and integrity not in MODES:
            raise ConfigError(f"kv_connector_extra_config.integrity must be one of {list(MODES)}, got {integrity!r}",
                              field="kv_connector_extra_config.integrity", fix="use off, sampled or full")
        latency_priority = extra.get("latency_priority")
        if latency_priority is not None and (isinstance(latency_priority, bool) or not isinstance(latency_priority, int)):
            raise ConfigError(f"kv_connector_extra_config.latency_priority must be an integer, got {latency_priority!r}",
                              field="kv_connector_extra_config.latency_priority",
                              fix="set the highest vLLM priority value whose requests are latency-class, e.g. 0")
        roles = ROLES_BY_KV_ROLE[kv_role]
        if "prefill" in roles and address is None and rendezvous is None:
            raise ConfigError(f"kv_role {kv_role} produces KV, so decode engines must be told where this node's "
                              "daemon is, and kv_connector_extra_config.address is unset",
                              field="kv_connector_extra_config.address",
                              fix="set address to host:control_port of this node's kvxferd daemon")
        return cls(instance=instance, roles=roles, socket_path=extra.get("socket_path"), address=address,
                   rendezvous=rendezvous, dp=dp, integrity=integrity, latency_priority=latency_priority, **timeouts)

    @property
    def source_address(self) -> str:
        """What decode names as this instance's address: the rendezvous, else this node's daemon."""
        address = self.rendezvous or self.address
        assert address is not None  # checked in from_config for a producer
        return address

    def instance_for(self, role: str) -> str:
        """The daemon keeps one role per instance name, so a kv_both engine registers two."""
        return f"{self.instance}.{role}"

    @property
    def produces(self) -> bool:
        return "prefill" in self.roles

    @property
    def consumes(self) -> bool:
        return "decode" in self.roles


def dp_of(data_parallel_index: int | None, data_parallel_size: int | None) -> tuple[int, int] | None:
    """``(dp_rank, dp_size)`` a worker registers with, from vLLM's parallel config.

    vLLM keeps ``data_parallel_size`` for MoE models, whose DP ranks are DP ranks of one engine
    (one KV cache each): those register as DP ranks of the instance. A dense model's DP ranks
    are independent engines (vLLM resets their size to 1 and suffixes each one's
    ``engine_id`` with ``_dp<k>``): None, each is an instance of its own.
    """
    size = int(data_parallel_size or 1)
    if size <= 1:
        return None
    rank = int(data_parallel_index or 0)
    if not 0 <= rank < size:
        raise ConfigError(f"data_parallel_rank {rank} is not below data_parallel_size {size}",
                          field="parallel_config.data_parallel_rank", fix="start vLLM's DP ranks with its launcher")
    return rank, size


# -- kv_transfer_params --------------------------------------------------------------------

@dataclass(frozen=True)
class TransferParams:
    """What prefill hands back in ``kv_transfer_params`` and decode must be given."""

    transfer_id: str
    source_instance: str
    source_address: str
    num_tokens: int
    source_dp_rank: int | None = None  # the prefill DP rank that holds the request (MoE DP engines)

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable; ``do_remote_prefill`` is the flag vLLM's proxies and decode look for."""
        body: dict[str, Any] = {"transfer_id": self.transfer_id, "source_instance": self.source_instance,
                                "source_address": self.source_address, "num_tokens": self.num_tokens}
        if self.source_dp_rank is not None:
            body["source_dp_rank"] = self.source_dp_rank
        return {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: body}

    @classmethod
    def from_request(cls, params: Mapping[str, Any] | None) -> "TransferParams | None":
        """The transfer a decode request should load, None when it asks for no remote prefill."""
        if not params or not params.get("do_remote_prefill"):
            return None
        body = params.get(PARAMS_KEY)
        if not isinstance(body, Mapping):
            raise ConfigError(f"kv_transfer_params has do_remote_prefill but no {PARAMS_KEY!r} object",
                              field=f"kv_transfer_params.{PARAMS_KEY}",
                              fix="pass decode the kv_transfer_params the prefill engine returned, unchanged")
        out = {}
        for key in ("transfer_id", "source_instance", "source_address"):
            value = body.get(key)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"kv_transfer_params.{PARAMS_KEY}.{key} must be a non-empty string, got {value!r}",
                                  field=f"kv_transfer_params.{PARAMS_KEY}.{key}",
                                  fix="pass decode the kv_transfer_params the prefill engine returned, unchanged")
            out[key] = value
        num_tokens = body.get("num_tokens")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ConfigError(f"kv_transfer_params.{PARAMS_KEY}.num_tokens must be a positive integer, "
                              f"got {num_tokens!r}", field=f"kv_transfer_params.{PARAMS_KEY}.num_tokens",
                              fix="pass decode the kv_transfer_params the prefill engine returned, unchanged")
        dp_rank = body.get("source_dp_rank")
        if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0):
            raise ConfigError(f"kv_transfer_params.{PARAMS_KEY}.source_dp_rank must be a non-negative integer, "
                              f"got {dp_rank!r}", field=f"kv_transfer_params.{PARAMS_KEY}.source_dp_rank",
                              fix="pass decode the kv_transfer_params the prefill engine returned, unchanged")
        return cls(num_tokens=num_tokens, source_dp_rank=dp_rank, **out)


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A prefill request: the proxy asked this engine to hand its KV to a decode engine."""
    return bool(params) and params.get("do_remote_decode") is True


# -- page math -----------------------------------------------------------------------------

def pages_for(block_ids: Sequence[int], start: int, end: int, page_size: int) -> list[int]:
    """The pages holding tokens ``[start, end)``, from the page of ``start`` (what ``send`` takes)."""
    first, stop = start // page_size, -(-end // page_size)
    if stop > len(block_ids):
        raise ConfigError(f"tokens [{start}, {end}) need {stop} pages of {page_size} tokens, the request holds "
                          f"{len(block_ids)} blocks", field="block_ids",
                          fix="this is a bookkeeping bug in the connector: report it")
    return [int(b) for b in block_ids[first:stop]]


def next_chunk(sent: int, computed: int, total: int, page_size: int) -> tuple[int, int, bool] | None:
    """The next ``(start, end, last)`` a prefill rank can send, or None.

    Only whole pages go out before the last chunk: vLLM's CPU layout packs a page's tokens
    head-major, so a page is the smallest unit the daemon can move, and a chunk may end
    inside a page only when it is the request's last.
    """
    if computed >= total:
        end = total
    else:
        end = computed // page_size * page_size
    if end <= sent:
        return None
    return sent, end, end == total


def group_pages(groups: Sequence[tuple[str, Sequence[int]]], start: int, end: int,
                page_size: int) -> dict[str, list[int]] | None:
    """Every other cache group's pages for ``[start, end)``, as :func:`pages_for` (None: no groups).

    vLLM's block size is the same in every group the connector maps (groups.map_groups), so
    one token range names the same page positions in each; a sliding-window group's entries
    before its window are vLLM's null block, which the daemons never read nor write."""
    if not groups:
        return None
    return {name: pages_for(blocks, start, end, page_size) for name, blocks in groups}


def load_error_blocks(block_ids: Sequence[int], start: int, num_tokens: int, page_size: int) -> set[int]:
    """The blocks a failed load was to fill: vLLM recomputes (or fails) from the first of them."""
    return set(int(b) for b in block_ids[start // page_size:-(-num_tokens // page_size)])


# -- what the scheduler tells its workers each step -----------------------------------------

@dataclass(frozen=True)
class LoadSpec:
    """Decode: expect ``transfer_id`` into ``block_ids``; tokens before ``start`` are local hits."""

    req_id: str
    params: TransferParams
    block_ids: tuple[int, ...]
    start: int
    #: the other cache groups' block ids, by kvxferd group name (vLLM's hybrid KV cache manager)
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class SaveSpec:
    """Prefill: after this step's forward, ``computed`` tokens of ``num_tokens`` are in ``block_ids``."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    computed: int
    num_tokens: int
    #: the other cache groups' block ids, by kvxferd group name (vLLM's hybrid KV cache manager)
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: the transfer class the request asks its daemon for (from its vLLM priority; None: its instance's)
    qos_class: str | None = None


@dataclass(frozen=True)
class StepPlan:
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    #: (req_id, transfer_id, role): abort at the daemon, report the request once it is terminal there
    aborts: tuple[tuple[str, str, str], ...] = ()
    #: (req_id, transfer_id): the request was preempted and its blocks go back to vLLM; abort and wait
    preempted: tuple[tuple[str, str], ...] = ()


@dataclass
class _Send:
    transfer_id: str
    num_tokens: int
    scheduled: bool = False
    qos_class: str | None = None


@dataclass
class SchedulerBook:
    """Scheduler-side state of every request the connector has a stake in."""

    settings: ConnectorSettings
    new_id: Callable[[], str] = field(default=lambda: uuid.uuid4().hex)
    sends: dict[str, _Send] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)
    #: req_id -> transfer_id of loads whose finished_recving has not come back yet
    loading: dict[str, str] = field(default_factory=dict)
    _loads: list[LoadSpec] = field(default_factory=list)
    _aborts: list[tuple[str, str, str]] = field(default_factory=list)

    # decode side
    def matched_tokens(self, req_id: str, params: Mapping[str, Any] | None, prompt_len: int,
                       num_computed: int) -> tuple[int, bool]:
        """Tokens to load asynchronously: every prompt token the local prefix cache lacks."""
        if not self.settings.consumes or req_id in self.loaded:
            return 0, False
        transfer = TransferParams.from_request(params)
        if transfer is None or transfer.num_tokens != prompt_len:
            # a transfer of another length cannot be this prompt's KV; recompute instead
            return 0, False
        count = prompt_len - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, req_id: str, params: Mapping[str, Any] | None, block_ids: Sequence[int],
                    prompt_len: int, num_external: int,
                    groups: tuple[tuple[str, tuple[int, ...]], ...] = (), priority: int | None = None) -> None:
        if num_external > 0 and req_id not in self.loaded:
            transfer = TransferParams.from_request(params)
            if transfer is not None:
                self.loaded.add(req_id)
                self.loading[req_id] = transfer.transfer_id
                self._loads.append(LoadSpec(req_id, transfer, tuple(int(b) for b in block_ids),
                                            prompt_len - num_external, groups))
        if self.settings.produces and wants_remote_decode(params) and req_id not in self.sends:
            self.sends[req_id] = _Send(self.new_id(), prompt_len, qos_class=self.settings.qos_class(priority))

    # both sides, once per step
    def plan(self, scheduled: Sequence[tuple[Any, ...]], preempted: Sequence[str] = ()) -> StepPlan:
        """``scheduled``: (req_id, block_ids, tokens computed once this step ran[, other groups'
        block ids by name])."""
        saves = []
        for req_id, block_ids, computed, *rest in scheduled:
            send = self.sends.get(req_id)
            if send is None:
                continue
            send.scheduled = True
            saves.append(SaveSpec(req_id, send.transfer_id, tuple(int(b) for b in block_ids),
                                  min(computed, send.num_tokens), send.num_tokens, rest[0] if rest else (),
                                  send.qos_class))
        gone = []
        for req_id in preempted:
            send = self.sends.pop(req_id, None)
            if send is not None and send.scheduled:
                gone.append((req_id, send.transfer_id))
        plan = StepPlan(tuple(self._loads), tuple(saves), tuple(self._aborts), tuple(gone))
        self._loads.clear()
        self._aborts.clear()
        return plan

    def received(self, req_ids: Sequence[str]) -> None:
        """``finished_recving`` came back from every worker for these requests."""
        for req_id in req_ids:
            self.loading.pop(req_id, None)

    def finished(self, req_id: str, *, computed: int, aborted: bool) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: (keep the blocks until the send is terminal, params for the output)."""
        self.loaded.discard(req_id)
        load = self.loading.get(req_id)
        if load is not None:
            # vLLM itself holds the blocks of a request still waiting for remote KV; stop the load
            self._aborts.append((req_id, load, "decode"))
        send = self.sends.pop(req_id, None)
        if send is None:
            return False, None
        if aborted or computed < send.num_tokens:
            if not send.scheduled:
                return False, None
            self._aborts.append((req_id, send.transfer_id, "prefill"))
            return True, None
        dp = self.settings.dp
        params = TransferParams(send.transfer_id, self.settings.instance_for("prefill"), self.settings.source_address,
                                send.num_tokens, source_dp_rank=dp[0] if dp else None)
        return True, params.to_json()


# -- worker-side bookkeeping ----------------------------------------------------------------

@dataclass
class _WorkerSend:
    req_id: str
    sent: int = 0            # tokens [0, sent) handed to the daemon
    last_sent: bool = False
    terminal: bool = False   # the daemon no longer reads its pages (or never held any)


@dataclass
class _WorkerLoad:
    req_id: str
    error_blocks: frozenset[int]


@dataclass
class WorkerBook:
    """Which daemon request belongs to which vLLM request on one worker, and what to report.

    vLLM wants ``finished_sending`` only for requests it has already told the worker are
    finished, and each worker reports each request once; the book keeps both rules. A send
    stays here until it is reported, so a failed one is never started again.
    """

    sends: dict[str, _WorkerSend] = field(default_factory=dict)   # transfer id -> state
    loads: dict[str, _WorkerLoad] = field(default_factory=dict)   # transfer id -> state
    _finished: set[str] = field(default_factory=set)              # req ids vLLM finished, not reported
    _recv_terminal: set[str] = field(default_factory=set)         # req ids
    _recv_failed: set[str] = field(default_factory=set)           # req ids whose load failed, not reported
    _load_errors: set[int] = field(default_factory=set)

    def send_state(self, transfer_id: str, req_id: str) -> _WorkerSend:
        return self.sends.setdefault(transfer_id, _WorkerSend(req_id))

    def send_terminal(self, transfer_id: str) -> str | None:
        send = self.sends.get(transfer_id)
        if send is None or send.terminal:
            return None
        send.terminal = True
        return send.req_id

    def send_dropped(self, transfer_id: str) -> None:
        """A preempted request's transfer: its request is not finished, so nothing is reported."""
        self.sends.pop(transfer_id, None)

    def abort_send(self, req_id: str, transfer_id: str) -> bool:
        """True when the daemon may hold chunks of it (abort there, report on its terminal event)."""
        send = self.sends.setdefault(transfer_id, _WorkerSend(req_id))
        if send.terminal:
            return False
        if send.sent == 0:
            send.terminal = True
            return False
        return True

    def load_started(self, transfer_id: str, req_id: str, error_blocks: set[int]) -> None:
        self.loads[transfer_id] = _WorkerLoad(req_id, frozenset(error_blocks))

    def load_terminal(self, transfer_id: str, ok: bool) -> str | None:
        load = self.loads.pop(transfer_id, None)
        if load is None:
            return None
        if not ok:
            self._load_errors |= load.error_blocks
            self._recv_failed.add(load.req_id)
        self._recv_terminal.add(load.req_id)
        return load.req_id

    def load_failed_now(self, req_id: str, error_blocks: set[int]) -> None:
        self._load_errors |= error_blocks
        self._recv_failed.add(req_id)
        self._recv_terminal.add(req_id)

    def take_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) to report this step."""
        # only ids this worker still has to report are kept, so the set stays bounded
        self._finished |= set(finished_req_ids) & {send.req_id for send in self.sends.values()}
        sending = set()
        for tid, send in list(self.sends.items()):
            if send.terminal and send.req_id in self._finished:
                del self.sends[tid]
                self._finished.discard(send.req_id)
                sending.add(send.req_id)
        recving, self._recv_terminal = self._recv_terminal, set()
        return sending, recving

    def take_failed(self, recving: set[str]) -> set[str]:
        """The requests of ``recving`` (this step's finished_recving) whose load failed: vLLM's
        ``failed_recving``, which a hybrid cache needs (its block ids are unique per group only)."""
        failed = self._recv_failed & recving
        self._recv_failed -= failed
        return failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
