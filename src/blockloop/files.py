"""Atomic file writes: readers see either the old file or the complete new one, never half of it.

Checkpoints, caches and metrics all go through here, so a run killed mid-write loses nothing that was
already on disk; :func:`run_lock` keeps a second process from writing the same run at the same time.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from blockloop.errors import BlockloopError

_T = TypeVar("_T")


def copy_into_place(src: IO[bytes], target: Path) -> None:
    """Stream ``src`` to ``target`` through a temporary file in the same folder, synced, then renamed. A file it
    replaces keeps its permissions (the rename would give it a new file's), and one read-only to this user is
    refused, as an ``open`` for writing would refuse it (the folder's permission alone allows the rename)."""
    target = _file_target(Path(target))
    mode = _replaced_mode(target)
    fd, tmp = _new_file_beside(target)
    try:
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out)
            out.flush()
            if mode is not None:
                os.chmod(tmp, mode)
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # a write's error names no file: name it
            raise type(exc)(exc.errno, exc.strerror, str(target)) from None
        raise


def new_file_mode(folder: Path) -> int:
    """The permissions a file created in ``folder`` gets (the umask, or the folder's default ACL), found by creating
    one: for a file another writer made private, as safetensors' temporary file is (0600)."""
    fd, probe = _new_file(folder)
    try:
        return os.fstat(fd).st_mode & 0o7777
    finally:
        os.close(fd)
        probe.unlink()


def check_writable(target: Path) -> None:
    """Fail now, with the error a write would give, if ``target`` cannot be written (a folder stands there, its
    folder is read-only): before long work whose result goes there, not after it. Folders the write would create
    are not made yet, so a run refused later leaves none behind."""
    target = _file_target(Path(target))
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
    _replaced_mode(target)
    folder = target.parent
    while not folder.exists() and not folder.is_symlink():
        folder = folder.parent
    try:
        if not folder.is_dir():  # a file where a folder of the path belongs
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(target))
        fd, tmp = _new_file(folder)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(target)) from None
    os.close(fd)
    tmp.unlink()


def _file_target(target: Path) -> Path:
    """What a write to ``target`` replaces: the file a symbolic link points to (the link stays a link), never a
    device, pipe or socket, which renaming a new file over would destroy (``--out /dev/null`` run as root)."""
    if target.is_symlink():
        target = target.resolve()
    if target.exists() and not target.is_file() and not target.is_dir():
        raise BlockloopError(f"{target} is not a regular file (a device, pipe or socket), which this write would "
                             "replace; give the path of a file")
    return target


def _replaced_mode(target: Path) -> int | None:
    """The permissions of the file at ``target`` that a write replaces (None: none there); one this user may not
    write is refused."""
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        return None
    if not os.access(target, os.W_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(target))
    return mode


def _new_file_beside(target: Path) -> tuple[int, Path]:
    """:func:`_new_file` in ``target``'s folder (created if missing); errors name ``target``, not the temporary."""
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return _new_file(target.parent)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(target)) from None


_FILE_PREFIX = ".tmp-"
_swept_for_files: set[Path] = set()  # the folders this process has already swept of abandoned files


def _new_file(folder: Path) -> tuple[int, Path]:
    """A new empty file in ``folder`` under an unused name, open for writing, named after its owner as
    :func:`new_dir`'s folders are: the first one a process makes in a folder removes those of processes that ended
    there without renaming or removing theirs (an extraction killed outright).

    Unlike ``tempfile.mkstemp``, which makes it private (0600), it gets the mode any new file gets (0666 less
    the umask, or what the folder's default ACL says): it is renamed into place as the real file, and a run
    shared with other users must stay readable to them. The kernel applies the umask, so it is never read.
    """
    # O_BINARY: no newline translation on Windows; O_EXCL: never someone else's file
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    swept = Path(folder).absolute()
    if swept not in _swept_for_files:  # once per folder, not at each file a run or an extraction writes there
        _remove_abandoned(folder, _FILE_PREFIX)
        _swept_for_files.add(swept)
    return _unused(folder, _owned(_FILE_PREFIX), lambda tmp: (os.open(tmp, flags, 0o666), tmp))


def new_dir(folder: Path, prefix: str) -> Path:
    """A new empty folder in ``folder`` under an unused name starting ``prefix``: ``tempfile.mkdtemp`` without its
    private mode (0700), for a folder that is renamed into place as the real one (as :func:`_new_file`).

    Its name says which process on which host owns it, so a process killed before it could rename or remove
    its folder (a converted model is hundreds of MB) does not leave it for good: the next call with the same
    ``prefix`` in ``folder`` removes it (:func:`_remove_abandoned`). Errors name ``folder``, not the new name.
    """
    _remove_abandoned(folder, prefix)
    try:
        return _unused(folder, _owned(prefix), lambda tmp: (tmp.mkdir(mode=0o777), tmp)[1])
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(folder)) from None


def _owned(prefix: str) -> str:
    """``prefix`` followed by this host and process: the start of the name of a temporary this process owns."""
    return f"{prefix}{_host_tag()}-{os.getpid()}-"


def _host_tag() -> str:
    """This host in eight hex digits: a host name may hold characters a file name should not."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _remove_abandoned(folder: Path, prefix: str) -> None:
    """Remove the temporaries (:func:`new_dir`'s folders, :func:`_new_file`'s files) named with ``prefix`` in
    ``folder`` for processes that have ended on this host. One of another host is kept: whether its process lives
    cannot be told from here (as :func:`run_lock`)."""
    owned = re.compile(re.escape(prefix) + r"([0-9a-f]{8})-([0-9]+)-[0-9a-f]{16}")
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return  # no folder yet (or unreadable, which creating the new folder will report)
    host = _host_tag()
    for entry in entries:
        owner = owned.fullmatch(entry.name)
        if owner and owner[1] == host and int(owner[2]) != os.getpid() and _gone(int(owner[2])):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)  # another process may be removing it too
            else:
                entry.unlink(missing_ok=True)


def check_new_folder(target: Path | str) -> Path:
    """``target`` as a Path, refused if something is there already other than an empty folder: a result written
    whole never merges with, or writes over, what a user put there."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise BlockloopError(f"{target} is a file, not a folder; choose a new folder name")
    if target.exists() and any(target.iterdir()):
        raise BlockloopError(f"{target} already exists and is not empty; choose another directory or delete it")
    return target


@contextlib.contextmanager
def folder_in_place(target: Path | str, *, shared: bool = False) -> Iterator[Path]:
    """A folder to build a whole result in, under a hidden name beside ``target``, renamed to ``target`` in one
    step when the block ends: a reader never sees half of it, and a write that fails leaves nothing behind (one
    killed outright leaves only the hidden ``.NAME.tmp-*`` folder, never a ``target`` that looks complete, and
    the next ``folder_in_place`` of the same ``target`` removes that folder).

    ``shared`` is for a cache entry that several processes may build at once, each with the same content: the
    first to finish puts its folder in place and the others drop theirs, where an output folder refuses to be
    written over (:func:`check_new_folder`).
    """
    target = Path(target) if shared else check_new_folder(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = new_dir(target.parent, f".{target.name}.tmp-")
    except OSError as exc:  # a read-only folder: name the folder the user gave, not the hidden one
        raise type(exc)(exc.errno, exc.strerror, str(target)) from None
    try:
        yield tmp
        try:
            tmp.rename(target)  # replaces an empty folder; fails if something appeared there meanwhile
        except OSError as exc:
            if not shared:
                raise BlockloopError(f"could not move the result into {target}: {exc}; choose another directory") from exc
            if not target.exists():
                raise
            # another process put the same entry in place first: keep theirs
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _unused(folder: Path, prefix: str, create: Callable[[Path], _T]) -> _T:
    """``create`` (which refuses a path that exists) at a random name in ``folder``, drawn again while taken."""
    while True:
        try:
            return create(folder / f"{prefix}{secrets.token_hex(8)}")
        except FileExistsError:
            continue


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (``flock`` on the folder itself, so no lock file is left behind) while
    a file in it is read, changed and renamed back: two processes appending to one file would otherwise each
    rename their own copy over the other's, and one's lines would be lost. A no-op where ``flock`` is missing."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) atomically."""
    copy_into_place(io.BytesIO(text.encode("utf-8")), path)


LOCK_FILE = "lock"


@contextlib.contextmanager
def run_lock(directory: Path, enabled: bool = True) -> Iterator[None]:
    """Hold ``directory/lock`` while a process writes a run, so a second one (a repeated command, ``--resume``
    while the original still trains) refuses instead of interleaving logs and overwriting checkpoints.

    The lock file (pid and host) appears complete or not at all: it is written aside and hard-linked into
    place, which fails if a lock is there. A lock whose process is gone on this host is stale and replaced.
    The directory is created if needed, and removed again on release, with the parents this call created, if
    the lock was all it ever held (a run refused for bad input leaves no empty folders behind).
    """
    if not enabled:
        yield
        return
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise BlockloopError(f"{directory} is a file; name a directory for the run")
    created = [folder for folder in (directory, *directory.parents) if not folder.exists()]  # deepest first
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / LOCK_FILE
    _acquire(lock)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        for folder in created:
            if any(folder.iterdir()):
                break
            folder.rmdir()


def _acquire(lock: Path) -> None:
    fd, tmp = _new_file(lock.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), **_torchrun_job()}, f)
        for _ in range(2):
            try:
                os.link(tmp, lock)
                return
            except FileExistsError:
                holder = _holder(lock)
                if holder is not None:
                    raise BlockloopError(
                        f"{lock.parent} is in use by process {holder['pid']} on {holder['host']} (lock file {lock}); "
                        "wait for it to finish, or use another --out; if that process is gone, delete the lock file"
                    ) from None
                lock.unlink(missing_ok=True)  # stale: its process died without releasing it
        raise BlockloopError(f"could not take the lock {lock}: another process keeps replacing it; try again")
    finally:
        tmp.unlink(missing_ok=True)


def running_here(directory: Path) -> int | None:
    """The pid of another live process on this host that holds ``directory``'s run lock (a run still being written),
    or None. Rank 0 of this torchrun job holds it for every rank, so to the others it is not another run."""
    lock = Path(directory) / LOCK_FILE
    holder = _holder(lock) if lock.is_file() else None
    if holder is None or holder["host"] != socket.gethostname() or holder["pid"] == os.getpid():
        return None
    return None if _same_launch(holder) else holder["pid"]


def held_by_this_job(directory: Path) -> bool | None:
    """Whether ``directory``'s run lock was taken by (rank 0 of) the torchrun launch this process belongs to; None
    when that cannot be told (a multi-node launch without ``--rdzv-id``, seen from another host)."""
    holder = _holder(Path(directory) / LOCK_FILE)
    return False if holder is None else _same_launch(holder)


def _same_launch(holder: dict[str, Any]) -> bool | None:
    """Whether the lock ``holder`` and this process were started by one torchrun launch (None: cannot be told)."""
    mine = _torchrun_job()
    if not mine:
        return False
    if holder["host"] == socket.gethostname() and holder.get("agent") is not None:
        return holder["agent"] == mine["agent"]  # the same torchrun agent started both
    return None if mine["job"] == "none" else holder.get("job") == mine["job"]


def _torchrun_job() -> dict[str, Any]:
    """Who launched this process: torchrun's id for the launch (fresh per ``--standalone`` launch, ``none`` for
    a multi-node one without ``--rdzv-id``) and its agent on this host, the workers' parent; empty outside it."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    return {} if job is None else {"job": job, "agent": os.getppid()}


def _holder(lock: Path) -> dict[str, Any] | None:
    """What the holder of ``lock`` wrote (pid, host and torchrun launch), or None when it is stale (its process is
    gone from this host, or it is unreadable)."""
    try:
        holder = json.loads(lock.read_text(encoding="utf-8"))
        holder.update(pid=int(holder["pid"]), host=str(holder["host"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return None  # never written whole: links are atomic, so this is not a live holder's file
    if holder["host"] != socket.gethostname():
        return holder  # cannot tell whether it is alive: assume it is
    return None if _gone(holder["pid"]) else holder


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended on this host.

    A zombie has: it exited and only waits for its parent to collect its status, which a container's PID 1
    that never reaps will never do. ``kill(pid, 0)`` still succeeds on it, so Linux's /proc/PID/stat tells
    (state Z, or X); without /proc (other systems), or where it hides other users' processes, kill's answer stands.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rpartition(b")")[2].strip()[:1] in (b"Z", b"X")  # the state follows the command name in ()
