"""What goes over the sockets: the msgpack protocol and its schemas, the typed messages built
on it, several messages coalesced into one multipart message, and who may speak (CURVE keys,
the allow-list, handshake outcomes)."""
