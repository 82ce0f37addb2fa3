"""The optional NIXL transport: one-sided WRITEs from prefill regions into decode regions
(:mod:`.transport`), the library as kvxferd loads it (:mod:`.api`), and the daemon's side of
it in handshakes (:mod:`.support`)."""
