"""The daemon's shells around the lifecycle core, on its event loop: the engine endpoint, the
decode side's links to prefill daemons and the prefill side's endpoint serving decode daemons,
the rendezvous, timers, and the daemon that wires them and drains them (:mod:`.daemon`)."""
