"""What an engine uses to work with its daemon: the client (:mod:`.client`), a KV cache in
memory the daemon can map (:mod:`.kv_cache`), and tensors an engine already owns, shared with
the daemon (:mod:`.engine_memory`). Apart from the daemon: nothing here imports it."""
