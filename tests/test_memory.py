"""Daemon-side mapping of engine KV memory: shared bytes, checks, release."""

from __future__ import annotations

import os

import pytest
import torch

from e2e_util import spec
from kvxferd.errors import RegistrationError
from kvxferd.geometry import RankGeometry
from kvxferd.memory import MemoryMapper, allocate_cpu


def test_daemon_mapping_shares_bytes_with_the_engine_and_is_released():
    geo = RankGeometry(spec(num_layers=2), 0, 0, 4)
    mapper = MemoryMapper(["/dev/shm"])
    with allocate_cpu(geo, name="mem-test") as cache:
        regions = mapper.map_regions(geo, cache.descriptors())
        assert set(regions) == {(0, "k"), (0, "v"), (1, "k"), (1, "v")}
        cache.k(1).view(torch.uint8).fill_(7)          # the engine writes ...
        assert int(regions[(1, "k")].flat.min()) == 7  # ... the daemon sees it
        regions[(0, "v")].flat.fill_(9)                # and the other way round
        assert int(cache.v(0).view(torch.uint8).max()) == 9
        assert int(cache.k(0).view(torch.uint8).max()) == 0  # regions do not overlap
        mapper.release_unused(r.flat for r in regions.values())
        assert len(mapper._files) == 1  # still in use: kept
        mapper.release_unused([])
        assert mapper._files == {}  # no rank uses the file: the mapping is dropped


def test_mapping_refuses_files_outside_the_shm_dirs_and_out_of_bounds(tmp_path):
    geo = RankGeometry(spec(num_layers=1), 0, 0, 2)
    mapper = MemoryMapper(["/dev/shm"])
    with allocate_cpu(geo, name="mem-test-2") as cache:
        outside = cache.descriptors()
        elsewhere = tmp_path / "kv"
        elsewhere.write_bytes(b"\0" * os.path.getsize(cache.path))  # a file outside /dev/shm
        outside[0]["path"] = str(elsewhere)
        with pytest.raises(RegistrationError) as err:
            mapper.map_regions(geo, outside)
        assert err.value.field == "regions.path"
        beyond = cache.descriptors()
        beyond[1]["offset"] = 1 << 30
        with pytest.raises(RegistrationError) as err:
            mapper.map_regions(geo, beyond)
        assert err.value.field == "regions.offset"
        missing = cache.descriptors()[:1]
        with pytest.raises(RegistrationError) as err:
            mapper.map_regions(geo, missing)
        assert err.value.field == "regions" and "missing" in str(err.value)
