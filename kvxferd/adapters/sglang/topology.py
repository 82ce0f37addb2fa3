"""Where an SGLang rank sits in its deployment, as kvxferd needs it. Pure: no I/O.

- **DP rank.** SGLang keeps one KV cache per data-parallel rank: attention DP
  (``--enable-dp-attention``: ``attn_dp_size`` groups in one TP group) or, without it,
  system DP (``--dp-size``: separate schedulers). kvxferd files each as the instance's DP rank
  ``<instance>@dp<k>`` (``register(..., dp=(k, size))``). Which of the two is the DP rank
  follows SGLang's own bootstrap server, so kvxferd's ``k`` is the ``prefill_dp_rank`` SGLang's
  decode side resolves: the attention DP rank when there is no system DP, else the system
  DP rank. Both above 1 at once is refused (SGLang's bootstrap table collides there too).
- **Rendezvous.** A deployment over several nodes has ranks at several daemons; each names
  the daemon of the deployment's first rank (node 0), the instance's rendezvous. An
  operator names it (``KVXFERD_SGLANG_RENDEZVOUS``), or it follows SGLang's multi-node
  settings: node 0 is ``--dist-init-addr``'s host, whose daemon listens on the same peer
  port as the local one; ranks on node 0 name their own daemon's advertised address, the
  exact string the daemon knows itself by.
- **Bootstrap host.** Ranks on other nodes reach the prefill bootstrap server on node 0, as
  SGLang's own backends do (``--dist-init-addr``'s host).
"""

from __future__ import annotations

from ...errors import RegistrationError

WILDCARD = ("", "0.0.0.0", "::")


def dp_group(attn_dp_rank: int, attn_dp_size: int, system_dp_rank: int | None,
             system_dp_size: int) -> tuple[int, int] | None:
    """``(dp_rank, dp_size)`` this rank registers with; None for a rank of a deployment without DP."""
    if attn_dp_size > 1 and system_dp_size > 1:
        raise RegistrationError(
            f"attn_dp_size is {attn_dp_size} and dp_size is {system_dp_size}; the kvxferd backend files a KV cache "
            "per DP rank of one kind (SGLang's bootstrap server does too)", field="attn_dp_size",
            fix="use attention DP (--dp-size N --enable-dp-attention) or system DP (--dp-size N), not both")
    if attn_dp_size > 1:
        return _checked(attn_dp_rank, attn_dp_size, "attn_dp_rank")
    if system_dp_size > 1:
        return _checked(int(system_dp_rank or 0), system_dp_size, "dp_rank")
    return None


def _checked(rank: int, size: int, name: str) -> tuple[int, int]:
    if not 0 <= rank < size:
        raise RegistrationError(f"{name} {rank} is not below its size {size}", field=name,
                                fix="start the scheduler through SGLang's launcher, which sets both")
    return rank, size


def host_of(address: str) -> str:
    """The host of ``host:port`` (brackets of an IPv6 literal dropped)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return address.strip("[]")
    return host.strip("[]")


def port_of(address: str, field: str) -> int:
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RegistrationError(f"{field} {address!r} is not host:port", field=field,
                                fix="name it as host:port")
    return int(port)


def multi_node(nnodes: int | None, dist_init_addr: str | None) -> bool:
    return bool(dist_init_addr) and int(nnodes or 1) > 1


def rendezvous(explicit: str | None, *, nnodes: int | None, node_rank: int | None, dist_init_addr: str | None,
               own_address: str) -> str | None:
    """The rendezvous daemon a rank names (None: a one-node deployment, the local daemon is it)."""
    if explicit:
        port_of(explicit, "KVXFERD_SGLANG_RENDEZVOUS")
        return explicit
    if not multi_node(nnodes, dist_init_addr):
        return None
    if int(node_rank or 0) == 0:
        return own_address
    host = host_of(str(dist_init_addr))
    port = port_of(own_address, "peer_endpoint")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bootstrap_host(explicit: str | None, *, nnodes: int | None, dist_init_addr: str | None,
                   serving_host: str | None) -> str:
    """Where a prefill rank reaches its deployment's bootstrap server."""
    if explicit:
        return explicit
    if multi_node(nnodes, dist_init_addr):
        return host_of(str(dist_init_addr))
    return "127.0.0.1" if not serving_host or serving_host in WILDCARD else serving_host
