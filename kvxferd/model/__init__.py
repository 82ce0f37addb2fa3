"""The pure model: what an instance's KV cache looks like (geometry, cache groups, data-parallel
ranks), who writes which heads and layers of whom (plans), and which bytes of which pages a
chunk moves (segments). No I/O, no clock: every daemon computes the same answers."""
