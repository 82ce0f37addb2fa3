"""``kvxferd bench``: throughput, latency and limits on loopback, every byte checked.

One invocation measures, on this machine:

- **limits**: a single-thread ``torch`` memcpy of the payload, a raw TCP stream between
  two processes (``sendall`` / ``recv_into``; and, from 512 MiB, as many streams side by
  side as a daemon opens data connections), and a one-copy through shared memory between
  two processes (``/dev/shm`` mapping -> private memory, and -> another mapping);
- **kvxferd** through real daemons (``python -m kvxferd serve``) and a real engine
  process (``python -m kvxferd.tools.bench.engine``): ``local`` (one daemon) and ``tcp`` (two
  daemons), ``direct`` and ``staged`` (``KVXFERD_PEER_MODE`` on the daemons), TP 1->1,
  2->1, 1->2, page-size mismatch, page size 1, MLA; one-page latency; small requests per
  second through a daemon pair;
- **peers** when installed: raw NIXL agent-to-agent over UCX/TCP and the Mooncake
  transfer engine over TCP (rows are skipped with a reason otherwise);
- **planner**: ``make_plan`` + ``request_segments`` for every writer of a 128k-token
  request on an 80-layer model.

The engine process allocates its ranks' caches in shared memory, registers them with
:class:`~kvxferd.sdk.client.EngineClient`, fills the prefill pages once from a seeded oracle
and then keeps a window of requests in flight, timing from the first ``send`` to the last
decode-side completion event. Before the timed run every destination page set is
written once (so the daemons' first-touch page faults are not timed); the page sets of
the checked requests are then reset to a canary, and after the run their bytes are
compared with the byte oracle (:mod:`kvxferd.tools.oracle`), along with pages that were
never destinations. A scenario that moves a wrong byte is reported and makes the whole
bench exit non-zero.

Targets are reported, never asserted; ``--plot`` draws them (:mod:`.plot`).

Modules: :mod:`.model` (workloads, rows, targets), :mod:`.scenarios` (what a run measures,
running one scenario), :mod:`.engine` with :mod:`.engine_sync` and :mod:`.engine_async`
(the engine process), :mod:`.limits`, :mod:`.peers`, :mod:`.plan_timing`,
:mod:`.machine` (others' CPU), :mod:`.report` (ratios, targets, table), :mod:`.plot`,
:mod:`.run` (one run), :mod:`.cli` (``kvxferd bench``).
"""
