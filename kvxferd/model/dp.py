"""Data-parallel attention: the DP ranks of an instance, as kvxferd sees them. Pure: no I/O.

With DP attention (SGLang's ``--enable-dp-attention``, vLLM's data-parallel ranks) an instance
of ``dp_size`` DP ranks keeps ``dp_size`` separate KV caches: a request lives in the cache of the
one DP rank that ran it, sharded over that DP rank's own attention TP x PP group. So a DP rank
*is* a source instance as far as moving bytes goes: its own geometry (attention TP size), its
own ranks, its own plan. A rank registered with ``dp_rank``/``dp_size`` is filed under the
instance ``<instance>@dp<dp_rank>``, a request names the DP rank that holds it
(``expect(..., source_dp_rank=k)``, SGLang's ``prefill_dp_rank``), and everything after that
(rendezvous, rank map, plan, fan-in, failures) is the machinery of any other instance. What
is DP-specific is kept here: the names, and the checks that every DP rank of an instance
agrees on ``dp_size`` and that a request names a DP rank the instance has.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanRefusal, RequestError

SEP = "@dp"
MAX_DP = 1 << 12


def dp_instance(instance: str, dp_rank: int) -> str:
    """The instance a DP rank's ranks are filed under."""
    return f"{instance}{SEP}{dp_rank}"


def split(name: str) -> tuple[str, int | None]:
    """``(instance, dp_rank)`` of a filed name; ``(name, None)`` for an instance without DP ranks."""
    base, sep, tail = name.rpartition(SEP)
    if sep and base and tail.isdigit():
        return base, int(tail)
    return name, None


def check_registration(instance: str, dp_rank: int | None, dp_size: int | None) -> None:
    """Both fields or neither, the rank inside the size, and no name that looks like a DP rank's."""
    if (dp_rank is None) != (dp_size is None):
        given, missing = ("dp_rank", "dp_size") if dp_size is None else ("dp_size", "dp_rank")
        raise RequestError(f"register names {given} but not {missing}", field=missing,
                           fix="send both dp_rank and dp_size (a data-parallel rank), or neither")
    if dp_rank is not None and dp_size is not None and not 0 <= dp_rank < dp_size:
        raise RequestError(f"dp_rank {dp_rank} is not below dp_size {dp_size}", field="dp_rank",
                           fix=f"register DP ranks 0..{dp_size - 1}")
    if SEP in instance:
        raise RequestError(f"instance name {instance!r} contains {SEP!r}, which names data-parallel ranks",
                           field="instance", fix="register with dp_rank and dp_size and a name without '@dp'")


@dataclass(frozen=True)
class DpSize:
    """An instance's ``dp_size`` as one of its ranks (``rank_id``, at ``daemon``) registered it."""

    dp_size: int
    rank_id: str
    daemon: str


SAME_SIZE_FIX = "start every DP rank of an instance with the same dp_size"


def size_mismatch(instance: str, rank_id: str, dp_size: int, daemon: str, seen: DpSize | None) -> str | None:
    """Why a DP rank's ``dp_size`` contradicts the instance's (None: it agrees, or is the first)."""
    if seen is None or seen.dp_size == dp_size:
        return None
    return (f"rank {rank_id} at {daemon} has dp_size = {dp_size}, but rank {seen.rank_id} of instance "
            f"{instance!r} at {seen.daemon} has dp_size = {seen.dp_size}")


def check_same_size(instance: str, rank_id: str, dp_size: int, daemon: str, seen: DpSize | None) -> None:
    """Every DP rank of an instance names the same ``dp_size``."""
    why = size_mismatch(instance, rank_id, dp_size, daemon, seen)
    if why is not None:
        raise RequestError(why, field="dp_size", fix=SAME_SIZE_FIX)


def check_request(instance: str, dp_rank: int, seen: DpSize | None, plain: bool) -> None:
    """A request names a DP rank the instance has (refused at once, naming both values)."""
    if seen is not None and dp_rank >= seen.dp_size:
        raise PlanRefusal(f"the request names prefill DP rank {dp_rank} of instance {instance!r}, which has "
                          f"dp_size = {seen.dp_size} (DP ranks 0..{seen.dp_size - 1}, as rank {seen.rank_id} "
                          "registered)", field="dp_rank", prefill=seen.dp_size, decode=dp_rank,
                          fix="name the DP rank that ran the request (SGLang's prefill_dp_rank)")
    if seen is None and plain:
        raise PlanRefusal(f"the request names prefill DP rank {dp_rank} of instance {instance!r}, whose ranks "
                          "registered without data-parallel ranks (no dp_size)", field="dp_rank",
                          prefill=None, decode=dp_rank,
                          fix="leave source_dp_rank out for this instance, or register its ranks with dp_rank "
                              "and dp_size")
