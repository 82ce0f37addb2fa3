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
for reading and writing in the registering engine's process (the pid its connection's peer
credentials name, :mod:`.engine_caller`), name a regular file, and be either a memfd sealed
against shrinking or a file inside ``engine.shm_dirs``. A memfd that allows sealing but is not
sealed yet is sealed by the daemon (seals live on the file, so the engine's own descriptor
cannot shrink it from then on either). A shrunk file under a mapping would kill the daemon
with SIGBUS at its next copy, and a named file cannot be sealed: named files (by path, or a
descriptor of one) are refused unless ``engine.allow_named_files``, and then must belong to
the engine's uid; such an engine is trusted not to shrink its file. The rule is checked on
the daemon's own descriptor after it opened the file, so the engine cannot swap the file
between check and use.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
import uuid
from dataclasses import dataclass

from ..errors import RegistrationError
from .engine_caller import TrustRefusal

log = logging.getLogger("kvxferd.shmfile")

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


NAMED_FIX = ("register a sealed memfd instead: kv_cache.allocate_cpu / engine_memory.share_in_place without "
             "shm_dir (the SDK's default); only where the daemon cannot see the engine's process (another pid "
             "namespace) and the engine is trusted not to shrink its file, set engine.allow_named_files = true")


def _named_refused(label: str) -> TrustRefusal:
    return TrustRefusal(
        "named_file", f"{label} is a named file, and engine.allow_named_files is false: a named file cannot be "
        "sealed, so the engine could shrink it under the daemon's mapping and kill the daemon (SIGBUS)",
        field="regions.path" if label.startswith("region file") else "regions.fd", fix=NAMED_FIX)


def _check_owner(fd: int, owner: int | None, label: str, field: str) -> None:
    """A named file must belong to the registering engine's uid: not another tenant's."""
    if owner is None:
        return
    uid = os.fstat(fd).st_uid
    if uid != owner:
        raise TrustRefusal(
            "file_owner", f"{label} belongs to uid {uid}, but the engine registering it runs as uid {owner}",
            field=field, fix="register memory the engine's own user created (a memfd from allocate_cpu, or a "
                             "file that user owns)")


def open_path(path: str, shm_dirs: list[str], *, named_ok: bool = True, owner: int | None = None) -> int:
    """Open a named region file: inside ``shm_dirs``, never through a symlink, owned by ``owner``
    (the engine's uid; None: not checked)."""
    if not named_ok:
        raise _named_refused(f"region file {path}")
    real = os.path.realpath(path)
    if not _inside(real, shm_dirs):
        raise TrustRefusal("outside_dirs", f"region file {path} is outside the allowed directories {shm_dirs}",
                           field="regions.path", fix="allocate KV memory under engine.shm_dirs")
    try:
        fd = os.open(real, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise RegistrationError(f"cannot open region file {path}: {exc.strerror}",
                                field="regions.path", fix="check the file exists and is readable") from None
    try:
        _check_owner(fd, owner, f"region file {path}", "regions.path")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _access_mode(pid: int, fd: int) -> int | None:
    """How engine process ``pid`` opened descriptor ``fd`` (O_RDONLY, O_WRONLY, O_RDWR); None: unknown."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as fh:
            for line in fh:
                if line.startswith(b"flags:"):
                    return int(line.split()[1], 8) & os.O_ACCMODE
    except (OSError, ValueError, IndexError):
        pass
    return None


def _seal_memfd(own: int, fd: int, pid: int) -> None:
    """Make sure a memfd cannot shrink: sealed already, or sealed here where it allows sealing."""
    seals = fcntl.fcntl(own, fcntl.F_GET_SEALS)
    if seals & fcntl.F_SEAL_SHRINK:
        return
    why = "it was created without MFD_ALLOW_SEALING" if seals & fcntl.F_SEAL_SEAL else ""
    if not why:
        try:
            fcntl.fcntl(own, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            log.info("event=memfd_sealed pid=%d fd=%d seals=0x%x note=%s", pid, fd, seals | fcntl.F_SEAL_SHRINK,
                     "the daemon sealed an engine's memfd against shrinking")
            return
        except OSError as exc:
            why = f"sealing it failed: {exc.strerror}"
    raise TrustRefusal(
        "unsealed", f"descriptor {fd} of engine process {pid} is a memfd not sealed against shrinking "
        f"(seals 0x{seals:x}) and the daemon cannot seal it ({why}); the engine could cut the daemon's mapping",
        field="regions.fd", fix="create it with MFD_ALLOW_SEALING and seal it: fcntl(fd, F_ADD_SEALS, "
                                "F_SEAL_SHRINK | F_SEAL_GROW) (kv_cache.allocate_cpu does)")


def open_engine_fd(pid: int | None, fd: int, shm_dirs: list[str], *, named_ok: bool = True,
                   owner: int | None = None) -> int:
    """Open descriptor ``fd`` of engine process ``pid`` and check it may be mapped (``owner``: the
    engine's uid, which a named file must belong to; None: not checked)."""
    if pid is None:
        raise RegistrationError(f"region names descriptor {fd} but there is no pid to open it in (register carried "
                                "no pid, or the registering process is not visible from the daemon)",
                                field="regions.fd",
                                fix="register with the client (it sends the engine's pid), from a process the "
                                    "daemon can see (the same pid namespace or a parent of it)")
    link = f"/proc/{pid}/fd/{fd}"
    mode = _access_mode(pid, fd)
    if mode is not None and mode != os.O_RDWR:
        raise TrustRefusal(
            "read_only", f"descriptor {fd} of engine process {pid} is not open for reading and writing",
            field="regions.fd", fix="register a descriptor the engine opened read-write (allocate_cpu's memfd)")
    try:
        own = os.open(link, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RegistrationError(
            f"cannot open descriptor {fd} of engine process {pid} ({link}): {exc.strerror}",
            field="regions.fd",
            fix="run the daemon as the engine's user in the engine's pid namespace or a parent of it") from None
    try:
        target = fd_target(own)  # the daemon's own descriptor: what it really opened
        if target.startswith(MEMFD_LINK):
            _seal_memfd(own, fd, pid)
        else:
            named = target[:-len(DELETED)] if target.endswith(DELETED) else target
            label = f"descriptor {fd} of engine process {pid} ({target})"
            if not named_ok:
                raise _named_refused(label)
            if not _inside(named, shm_dirs):
                raise TrustRefusal(
                    "outside_dirs", f"descriptor {fd} of engine process {pid} is {target}, neither a memfd nor a "
                    f"file in the allowed directories {shm_dirs}", field="regions.fd",
                    fix="register a memfd (kvxferd.sdk: kv_cache.allocate_cpu / engine_memory.share_in_place) or a "
                        "file under engine.shm_dirs")
            _check_owner(own, owner, label, "regions.fd")
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
