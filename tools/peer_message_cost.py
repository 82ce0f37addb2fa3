"""CPU a daemon spends per peer control message: pings from a raw DEALER, one per ZeroMQ
message or ``--parts`` to a multipart message, answered (pong) by a real daemon.

Reads the daemon's own CPU time (``/proc/<pid>/stat``) before and after, so other load on
the machine changes the rate, less the CPU per message. Prints one JSON line.

    python tools/peer_message_cost.py --messages 20000 --parts 1
    python tools/peer_message_cost.py --messages 20000 --parts 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

import msgpack
import zmq

from kvxferd.tools.sim import Cluster


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def run(messages: int, parts: int, window: int) -> dict[str, float | int]:
    cluster = Cluster()
    sock = None
    try:
        daemon = cluster.daemon("peer-cost")
        assert daemon.proc is not None
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 30_000)
        sock.connect(f"tcp://{daemon.address}")
        ping = [msgpack.packb({"op": "ping", "daemon": "127.0.0.1:1", "seq": i}) for i in range(window)]
        sock.send(ping[0])
        sock.recv()  # connected and answered once before the clock starts
        before, started = cpu_s(daemon.proc.pid), time.monotonic()
        answered = 0
        while answered < messages:
            n = min(window, messages - answered)
            for i in range(0, n, parts):
                sock.send_multipart(ping[i:min(i + parts, n)])
            for _ in range(n):
                sock.recv()  # part by part, as any decode daemon reads
            answered += n
        seconds, used = time.monotonic() - started, cpu_s(daemon.proc.pid) - before
        return {"messages": messages, "parts": parts, "window": window, "seconds": round(seconds, 3),
                "messages_per_s": round(messages / seconds), "daemon_cpu_s": round(used, 3),
                "daemon_cpu_us_per_message": round(used / messages * 1e6, 1)}
    finally:
        if sock is not None:
            sock.close(0)
        cluster.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--parts", type=int, default=1, help="pings per multipart message (1: one each)")
    ap.add_argument("--window", type=int, default=256, help="pings in flight")
    args = ap.parse_args()
    print(json.dumps(run(args.messages, args.parts, args.window)))


if __name__ == "__main__":
    main()
