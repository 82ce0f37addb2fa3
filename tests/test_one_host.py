"""Two daemons on one host, from the shipped example (configs/one-host/): how a newcomer tries
prefill/decode before going to two machines.

The files are used as shipped except for their ports, which a busy test machine may hold
(the same rewrite the test clusters use), and the engine socket, which the test sets the way
an engine's shell would: with KVXFERD_ENGINE_SOCKET_PATH, which the daemon must name as the
source that won over its file.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from kvxferd.model.geometry import InstanceSpec, RankGeometry
from kvxferd.ops import config
from kvxferd.sdk.client import EngineClient
from kvxferd.sdk.kv_cache import allocate_cpu
from kvxferd.tools.sim import DaemonProc

from test_ops_config import CONFIGS, ROOT, clean_env

PAIR = CONFIGS / "one-host"


def test_the_pair_shares_no_socket_port_or_directory():
    prefill, decode = (config.load(PAIR / f"{role}.toml", environ={}) for role in ("prefill", "decode"))
    assert prefill.socket_path != decode.socket_path
    ports = [c.peer.control_port for c in (prefill, decode)] + [c.peer.data_port for c in (prefill, decode)] + \
        [int(c.metrics.bind.rpartition(":")[2]) for c in (prefill, decode)]
    assert len(set(ports)) == len(ports), ports
    for c in (prefill, decode):
        assert c.peer.bind_host == "127.0.0.1" and c.metrics.bind.startswith("127.0.0.1:")


def test_check_config_names_where_each_value_came_from():
    file = PAIR / "prefill.toml"
    out = subprocess.run([sys.executable, "-m", "kvxferd", "serve", "--check-config", str(file)], capture_output=True,
                         text=True, cwd=ROOT, timeout=60,
                         env=clean_env(KVXFERD_ENGINE_SOCKET_PATH="/tmp/elsewhere.sock", KVXFERD_PEER_MODE="staged"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"  peer.control_port = 5557  ({file})" in lines
    assert f"  engine.socket_path = '/tmp/elsewhere.sock'  (KVXFERD_ENGINE_SOCKET_PATH), over " \
           f"'/tmp/kvxferd-one-host/prefill.sock' from {file}" in lines
    assert "  peer.mode = 'staged'  (KVXFERD_PEER_MODE)" in lines  # not in the file: no "over"
    assert not any(line.startswith("  peer.transport ") for line in lines)  # defaults are not listed


def test_the_pair_starts_from_its_files_and_moves_a_request(tmp_path):
    daemons: list[DaemonProc] = []
    try:
        for role in ("prefill", "decode"):
            path = tmp_path / f"{role}.toml"
            path.write_text((PAIR / f"{role}.toml").read_text())
            sock = str(tmp_path / f"{role}.sock")
            d = DaemonProc(role, tmp_path, sock, 0, 0, 0, path)
            d._move_ports()
            daemons.append(d)
            d.start(env={**clean_env(), "KVXFERD_ENGINE_SOCKET_PATH": sock})
            assert (f"event=config_env_override key=engine.socket_path var=KVXFERD_ENGINE_SOCKET_PATH "
                    f"value={sock}") in d.log() and f"/tmp/kvxferd-one-host/{role}.sock" in d.log()
        prefill, decode = daemons
        spec = InstanceSpec("mha", 2, 16, "bfloat16", 4, total_kv_heads=2)
        geo = RankGeometry(spec, 0, 0, 8)
        with allocate_cpu(geo, name="oh-p") as src, allocate_cpu(geo, name="oh-d") as dst, \
                EngineClient(prefill.socket_path) as pc, EngineClient(decode.socket_path) as dc:
            g = torch.Generator().manual_seed(7)
            for t in src.tensors.values():
                t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16, generator=g))
            p_rank = pc.register("oh-prefill", "prefill", geo, src.descriptors())
            d_rank = dc.register("oh-decode", "decode", geo, dst.descriptors())
            dc.expect(d_rank, "oh-1", source_instance="oh-prefill", source_address=prefill.address, pages=[5, 2, 7],
                      num_tokens=12)
            pc.send(p_rank, "oh-1", pages=[1, 4, 0], start=0, end=12, last=True)
            assert dc.wait(d_rank, "oh-1", timeout=60)["state"] == "done"
            assert pc.wait(p_rank, "oh-1", timeout=60)["state"] == "done"
            for key, t in src.tensors.items():
                for s, d in zip([1, 4, 0], [5, 2, 7]):
                    assert torch.equal(dst.tensors[key][d].view(torch.int16), t[s].view(torch.int16)), (key, s, d)
                assert int(dst.tensors[key][[0, 1, 3, 4, 6]].count_nonzero()) == 0
    finally:
        for d in daemons:
            d.stop()
