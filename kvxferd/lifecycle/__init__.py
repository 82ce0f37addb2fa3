"""The request lifecycle, apart from I/O: states and transitions (:mod:`.states`), the one
book of plans and routes (:mod:`.routes`), typed events in (:mod:`.events`), effects out
(:mod:`.effects`), and the core that turns one into the other (:mod:`.core`)."""
