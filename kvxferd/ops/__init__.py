"""What an operator sets and sees: the configuration, structured logs, Prometheus metrics and
their HTTP endpoint, systemd's notify protocol, and tools that clean up when stopped."""
