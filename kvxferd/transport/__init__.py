"""Transports move chunk jobs (one chunk, one writer to one destination) between daemons: tcp
(:mod:`.tcp`), within one daemon (:mod:`.local`) and NIXL (:mod:`.nixl`), all behind one
object (:mod:`.hub`) and driven by the data plane's threads (:mod:`.dataplane`)."""
