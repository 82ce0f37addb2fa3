"""The request lifecycle, apart from I/O: states and transitions (:mod:`.states`), the requests
at each side (:mod:`.inbox` for destinations, :mod:`.outbox` for sources), the ranks registered
here (:mod:`.registry`), the one book of plans and routes (:mod:`.routes`), typed events in
(:mod:`.events`), effects out (:mod:`.effects`), and the core that turns one into the other
(:mod:`.core`, its two sides :mod:`.decode` and :mod:`.prefill` on :mod:`.base`)."""
