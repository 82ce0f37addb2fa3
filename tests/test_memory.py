"""Daemon-side mapping of engine KV memory: shared bytes, checks, release."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch

from e2e_util import spec
from kvxferd.datapath.regions import MemoryMapper
from kvxferd.errors import RegistrationError
from kvxferd.model.geometry import RankGeometry
from kvxferd.sdk.kv_cache import allocate_cpu

PID = os.getpid()  # the test process is the engine: the mapper opens its descriptors


def test_daemon_mapping_shares_bytes_with_the_engine_and_is_released():
    geo = RankGeometry(spec(num_layers=2), 0, 0, 4)
    mapper = MemoryMapper(["/dev/shm"])
    with allocate_cpu(geo, name="mem-test") as cache:
        assert cache.path is None and all("fd" in d and "path" not in d for d in cache.descriptors())
        regions = mapper.map_regions(geo, cache.descriptors(), PID)
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
    with allocate_cpu(geo, name="mem-test-2", shm_dir="/dev/shm") as cache:  # a named file
        assert cache.path.startswith("/dev/shm/kvxferd-mem-test-2-")
        assert mapper.map_regions(geo, cache.descriptors()).keys() == {(0, "k"), (0, "v")}
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


def test_descriptor_regions_follow_the_same_rule_as_paths(tmp_path):
    """A region named by descriptor opens /proc/<pid>/fd/<fd>: only a memfd sealed against
    shrinking (sealed by the daemon where it allows sealing, refused where it cannot be), or a
    file in the shm dirs (named or unlinked), of the registering process, opened read-write."""
    geo = RankGeometry(spec(num_layers=1), 0, 0, 2)
    mapper = MemoryMapper(["/dev/shm"])

    def refused(regions, pid=PID) -> RegistrationError:
        with pytest.raises(RegistrationError) as err:
            mapper.map_regions(geo, regions, pid)
        assert err.value.field == "regions.fd", err.value
        assert mapper._files == {}  # a refused region maps nothing
        return err.value

    with allocate_cpu(geo, name="mem-fd") as cache:
        assert "no pid" in str(refused(cache.descriptors(), None))
        size = os.fstat(cache.fd).st_size
        loose = os.memfd_create("kvxferd-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        stuck = os.memfd_create("kvxferd-unsealable", os.MFD_CLOEXEC)  # F_SEAL_SEAL from birth
        outside = os.open(tmp_path / "kv", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            for fd in (loose, stuck, outside):
                os.ftruncate(fd, size)
            err = refused([{**d, "fd": stuck} for d in cache.descriptors()])
            assert "not sealed against shrinking" in str(err) and "MFD_ALLOW_SEALING" in str(err)
            readonly = os.open(f"/proc/self/fd/{loose}", os.O_RDONLY | os.O_CLOEXEC)
            try:  # the daemon would reopen it read-write: a read-only descriptor is refused
                assert "reading and writing" in str(refused([{**d, "fd": readonly} for d in cache.descriptors()]))
            finally:
                os.close(readonly)
            elsewhere = [{**d, "fd": outside} for d in cache.descriptors()]
            err = refused(elsewhere)
            assert str(tmp_path / "kv") in str(err) and "/dev/shm" in str(err)
            unsealed = [{**d, "fd": loose} for d in cache.descriptors()]
            assert not fcntl.fcntl(loose, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
            assert len(mapper.map_regions(geo, unsealed, PID)) == 2  # sealable: sealed by the daemon, accepted
            assert fcntl.fcntl(loose, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
            with pytest.raises(PermissionError):
                os.ftruncate(loose, size // 2)  # the engine cannot shrink it any more either
            mapper.release_unused([])
        finally:
            for fd in (loose, stuck, outside):
                os.close(fd)
        closed = os.dup(cache.fd)
        os.close(closed)  # a descriptor number the engine does not hold
        err = refused([{**d, "fd": closed} for d in cache.descriptors()])
        assert f"descriptor {closed} of engine process {PID}" in str(err)
    with allocate_cpu(geo, name="mem-unlinked", shm_dir="/dev/shm") as cache:
        fd = os.open(cache.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.unlink(cache.path)  # a file of the shm dirs without a name any more
            regions = mapper.map_regions(geo, [{**d, "fd": fd, "path": None} for d in cache.descriptors()], PID)
            cache.k(0).view(torch.uint8).fill_(3)
            assert int(regions[(0, "k")].flat.min()) == 3
        finally:
            os.close(fd)


def test_a_cuda_handle_names_its_gpu_by_uuid_and_an_unseen_one_is_refused():
    """The engine's device index is its own numbering (CUDA_VISIBLE_DEVICES): the daemon finds
    the GPU by UUID, keeps the index only for handles without one, and refuses a GPU it cannot see."""
    import torch

    from kvxferd.datapath.cuda_ipc import local_device
    from kvxferd.errors import RegistrationError

    assert local_device({"device": 3}) == 3  # an older client: its index as sent
    with pytest.raises(RegistrationError) as err:
        local_device({"device": 0, "uuid": "GPU-00000000-0000-0000-0000-000000000000"})
    assert err.value.field == "regions.handle.uuid" and "CUDA_VISIBLE_DEVICES" in str(err.value)
    assert f"({torch.cuda.device_count()} GPUs here)" in str(err.value)


def test_named_files_are_refused_where_not_allowed_and_must_be_the_engines_own():
    """A named file cannot be sealed: with allow_named_files off it is refused by path and by
    descriptor, naming the fix; where allowed, it must belong to the registering uid."""
    geo = RankGeometry(spec(num_layers=1), 0, 0, 2)
    strict = MemoryMapper(["/dev/shm"], allow_named_files=False)
    lenient = MemoryMapper(["/dev/shm"], allow_named_files=True)
    with allocate_cpu(geo, name="mem-named", shm_dir="/dev/shm") as cache:
        fd = os.open(cache.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            by_fd = [{**d, "fd": fd, "path": None} for d in cache.descriptors()]
            for regions, field in ((cache.descriptors(), "regions.path"), (by_fd, "regions.fd")):
                with pytest.raises(RegistrationError) as err:
                    strict.map_regions(geo, regions, PID, os.getuid())
                assert err.value.field == field and err.value.reason == "named_file"
                assert "engine.allow_named_files" in str(err.value) and "memfd" in str(err.value)
                assert strict._files == {}
                with pytest.raises(RegistrationError) as err:
                    lenient.map_regions(geo, regions, PID, os.getuid() + 1)
                assert err.value.reason == "file_owner" and err.value.field == field
                assert f"uid {os.getuid()}" in str(err.value) and f"uid {os.getuid() + 1}" in str(err.value)
                assert len(lenient.map_regions(geo, regions, PID, os.getuid())) == 2
                lenient.release_unused([])
        finally:
            os.close(fd)
    with allocate_cpu(geo, name="mem-sealed") as cache:  # a sealed memfd: what the strict daemon takes
        assert len(strict.map_regions(geo, cache.descriptors(), PID, os.getuid())) == 2
        strict.release_unused([])
