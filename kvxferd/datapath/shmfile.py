"""The memory behind an engine's CPU KV cache, and how a daemon may open it.

By default the cache is an anonymous ``memfd``: it has no name in ``/dev/shm``, so it
lives exactly as long as some process maps it or holds a descriptor of it. An engine
killed with SIGKILL therefore leaves nothing behind once its daemon let go of it, and a
daemon killed leaves nothing once its engines exit. The engine keeps its descriptor open
for as long as it shares the cache, and registers it as ``fd`` plus its ``pid``; the daemon
opens ``/proc/<pid>/fd/<fd>`` (the engine's own descriptor, on the same host), which works
again after a daemon restart because the engine still holds it.

A named file in a directory (``shm_dir``) is still available for a daemon that cannot see
the engine's pids (another pid namespace); such a file outlives a killed engine.

The daemon-side rule for descriptors mirrors the one for paths: the descriptor must be open
in the registering engine's process, name a regular file, and be either a memfd sealed
against shrinking (so the engine cannot cut the mapping from under the daemon) or a file
inside ``engine.shm_dirs``. The rule is checked on the daemon's own descriptor after it
opened the file, so the engine cannot swap the file between check and use.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import uuid
from dataclasses import dataclass

from ..errors import RegistrationError

MEMFD_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
DELETED = " (deleted)"
MEMFD_LINK = "/memfd:"


@dataclass
class SharedFile:
    """One freshly created shared mapping: ``fd`` stays open (memfd) or is None (named file)."""

    mm: mmap.mmap
    size: int
    name: str  # the memfd's name or the file's base name (kvxferd-<name>-<random>)
    fd: int | None
    path: str | None


def unique_name(name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
    return f"kvxferd-{safe}-{uuid.uuid4().hex[:12]}"


def create(name: str, size: int, shm_dir: str | None = None) -> SharedFile:
    """A shared mapping of ``size`` bytes: a sealed memfd, or a file in ``shm_dir`` if given."""
    full = unique_name(name)
    if shm_dir is None:
        fd = os.memfd_create(full, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        path = None
    else:
        path = os.path.join(shm_dir, full)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        if path is None:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        if path is not None:
            unlink(path)
        raise
    if path is not None:  # a named file is opened again by its path; the descriptor is not needed
        os.close(fd)
        fd = None
    return SharedFile(mm, size, full, fd, path)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def close_fd(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def fd_target(fd: int) -> str:
    """What ``/proc/self/fd/<fd>`` points at ('/memfd:kvxferd-... (deleted)', a path, ...)."""
    return os.readlink(f"/proc/self/fd/{fd}")


# -- daemon side -----------------------------------------------------------------------------

def _inside(path: str, dirs: list[str]) -> bool:
    return any(path.startswith(d + os.sep) for d in dirs)


def open_path(path: str, shm_dirs: list[str]) -> int:
    """Open a named region file: inside ``shm_dirs``, never through a symlink."""
    real = os.path.realpath(path)
    if not _inside(real, shm_dirs):
        raise RegistrationError(f"region file {path} is outside the allowed directories {shm_dirs}",
                                field="regions.path", fix="allocate KV memory under engine.shm_dirs")
    try:
        return os.open(real, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise RegistrationError(f"cannot open region file {path}: {exc.strerror}",
                                field="regions.path", fix="check the file exists and is readable") from None


def open_engine_fd(pid: int | None, fd: int, shm_dirs: list[str]) -> int:
    """Open descriptor ``fd`` of engine process ``pid`` and check it may be mapped."""
    if pid is None:
        raise RegistrationError(f"region names descriptor {fd} but register carried no pid",
                                field="regions.fd", fix="register with the client, which sends the engine's pid")
    link = f"/proc/{pid}/fd/{fd}"
    try:
        own = os.open(link, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RegistrationError(
            f"cannot open descriptor {fd} of engine process {pid} ({link}): {exc.strerror}",
            field="regions.fd",
            fix="run the daemon as the engine's user in the engine's pid namespace, or allocate the "
                "cache as a named file under engine.shm_dirs (shm_dir=...) and register its path") from None
    try:
        target = fd_target(own)  # the daemon's own descriptor: what it really opened
        if target.startswith(MEMFD_LINK):
            seals = fcntl.fcntl(own, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK:
                raise RegistrationError(
                    f"descriptor {fd} of engine process {pid} is a memfd not sealed against shrinking "
                    f"(seals 0x{seals:x}); the engine could cut the daemon's mapping",
                    field="regions.fd", fix="seal it: fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)")
        else:
            named = target[:-len(DELETED)] if target.endswith(DELETED) else target
            if not _inside(named, shm_dirs):
                raise RegistrationError(
                    f"descriptor {fd} of engine process {pid} is {target}, neither a memfd nor a file in the "
                    f"allowed directories {shm_dirs}", field="regions.fd",
                    fix="register a memfd (kvxferd.sdk: kv_cache.allocate_cpu / engine_memory.share_in_place) or a "
                        "file under engine.shm_dirs")
    except BaseException:
        os.close(own)
        raise
    return own


def map_open(fd: int, label: str, field: str) -> tuple[mmap.mmap, os.stat_result]:
    """Map the whole of an opened region file, which must be a non-empty regular file."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        raise RegistrationError(f"region file {label} is not a non-empty regular file",
                                field=field, fix="use the memory allocate_cpu or share_in_place made")
    return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), st
