"""Atomic writes and the run lock against what a shared machine does to them, and OS errors in one line.

A lock left by a zombie (a killed run under a PID 1 that never reaps) is stale; files written atomically get
the mode of any new file, not mkstemp's private 0600; an OS error naming a path, whatever its errno, is one
line on stderr with exit code 2.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blockloop.cli import EXIT_USER_ERROR, main
from blockloop.files import atomic_write_text, folder_in_place, new_dir, run_lock


def _state(pid: int) -> bytes:
    return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to make and see a zombie")
def test_a_lock_held_by_a_zombie_is_stale(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", ""])  # not waited for: it stays a zombie until reaped
    try:
        deadline = time.monotonic() + 30
        while _state(child.pid) != b"Z":
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        run = tmp_path / "run"
        run.mkdir()
        (run / "lock").write_text(json.dumps({"pid": child.pid, "host": socket.gethostname()}))
        with run_lock(run):
            assert json.loads((run / "lock").read_text())["pid"] == os.getpid()
    finally:
        child.wait()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)], ids=["022", "077"])
def test_atomically_written_files_get_the_mode_of_a_new_file(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "latest", "step_0000002\n")
        with run_lock(tmp_path / "run"):
            lock_mode = stat.S_IMODE((tmp_path / "run" / "lock").stat().st_mode)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "latest").stat().st_mode) == mode
    assert lock_mode == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temporary file left behind


def test_a_folder_written_atomically_gets_the_mode_of_a_new_folder(tmp_path):
    """``tasks make`` writes its splits into a temporary folder renamed into place (as the token cache and the
    package downloads do): that folder must not keep mkdtemp's private 0700."""
    old = os.umask(0o022)
    try:
        assert main(["tasks", "make", "random-walk", "--out", str(tmp_path / "walk"), "--sizes", "2,2,2"]) == 0
        folder = new_dir(tmp_path, ".tmp-")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "walk").stat().st_mode) == 0o755
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755 and folder.name.startswith(".tmp-")


_KILLED_MIDWAY = """
import os, signal, sys
from blockloop.files import folder_in_place
with folder_in_place(sys.argv[1]) as tmp:
    (tmp / "model.safetensors").write_bytes(bytes(1000))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_hidden_folder_of_a_killed_write_is_removed_by_the_next_one(tmp_path):
    """A conversion killed outright leaves its hidden folder (hundreds of MB for a real model): the next write of
    the same --out removes it, as its process has ended, and keeps every folder that may still be in use: one of
    a live process, one of another host (whose processes cannot be seen), another target's, and any other name."""
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", _KILLED_MIDWAY, str(out)])
    assert killed.returncode == -signal.SIGKILL
    [abandoned] = tmp_path.iterdir()
    _, host, dead, _ = abandoned.name.split("-")  # .out.tmp-HOST-PID-TOKEN
    assert abandoned.name.startswith(".out.tmp-") and not out.exists()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        other_host = format(int(host, 16) ^ 1, "08x")
        kept = [
            f".out.tmp-{host}-{live.pid}-{'0' * 16}",
            f".out.tmp-{other_host}-{dead}-{'1' * 16}",
            f".other.tmp-{host}-{dead}-{'2' * 16}",
            f".out.tmp-x.tmp-{host}-{dead}-{'3' * 16}",  # the folder of a target named "out.tmp-x"
            ".out.tmp-notes",
        ]
        for name in kept:
            (tmp_path / name).mkdir()
        with folder_in_place(out) as tmp:
            (tmp / "model.safetensors").write_bytes(bytes(10))
    finally:
        live.stdin.close()
        live.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *kept])


_KILLED_MID_FILE = """
import os, signal, sys
from pathlib import Path
from blockloop.files import copy_into_place

class Killing:
    def read(self, size=-1):
        os.kill(os.getpid(), signal.SIGKILL)

copy_into_place(Killing(), Path(sys.argv[1]))
"""


def test_the_temporary_file_of_a_killed_write_is_removed_by_the_next_write_there(tmp_path):
    """An extraction killed outright mid-file leaves its temporary beside the file it was writing: the first
    atomic write of a later process in that folder removes it, and keeps the temporaries that may be in use."""
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_FILE, str(tmp_path / "corpus.txt")])
    assert killed.returncode == -signal.SIGKILL
    [abandoned] = tmp_path.iterdir()
    _, host, dead, _ = abandoned.name.split("-")  # .tmp-HOST-PID-TOKEN
    assert abandoned.name.startswith(".tmp-") and abandoned.is_file()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        kept = [
            f".tmp-{host}-{live.pid}-{'0' * 16}",
            f".tmp-{format(int(host, 16) ^ 1, '08x')}-{dead}-{'1' * 16}",  # another host's
            f".tmp-{'2' * 16}",  # no owner in its name
        ]
        for name in kept:
            (tmp_path / name).write_bytes(b"")
        later = "import sys; from blockloop.files import atomic_write_text; atomic_write_text(sys.argv[1], '[]')"
        subprocess.run([sys.executable, "-c", later, str(tmp_path / "index.json")], check=True)
    finally:
        live.stdin.close()
        live.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["index.json", *kept])


@pytest.mark.parametrize("shared", [True, False], ids=["cache-entry", "output"])
def test_a_folder_filled_meanwhile_is_kept(tmp_path, shared):
    """Two processes filling the same cache entry (the token cache, a package download) both succeed and the
    first one's folder stays; an output folder someone filled while a conversion wrote is refused, never merged."""
    from blockloop.errors import BlockloopError

    target = tmp_path / "entry"
    raised = contextlib.nullcontext() if shared else pytest.raises(BlockloopError, match="could not move the result")
    with raised:
        with folder_in_place(target, shared=shared) as tmp:
            (tmp / "meta.json").write_text("ours")
            target.mkdir()
            (target / "meta.json").write_text("theirs")
    assert [p.name for p in tmp_path.iterdir()] == ["entry"] and (target / "meta.json").read_text() == "theirs"


def test_a_folder_that_cannot_be_made_beside_out_names_out(tmp_path, monkeypatch, capsys):
    """Where --out's folder refuses new entries, the one-line error names --out, not the hidden folder that
    was to be built beside it (a name the user never gave)."""
    mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.name.startswith(".walk.tmp-"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    out = tmp_path / "walk"
    assert main(["tasks", "make", "random-walk", "--out", str(out), "--sizes", "2,2,2"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(out) in err and "Permission denied" in err and ".tmp-" not in err, err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(PermissionError) as refused:  # the corpus cache and package downloads: the folder
        new_dir(tmp_path, ".walk.tmp-")
    assert refused.value.filename == str(tmp_path)


@pytest.mark.parametrize("code", [errno.ENOENT, errno.EIO], ids=["ENOENT", "EIO"])
def test_any_os_error_naming_a_path_is_one_line(monkeypatch, capsys, code):
    from blockloop.cli import presets

    def refuse(args):
        raise OSError(code, os.strerror(code), "/some/where/file")

    monkeypatch.setattr(presets, "run", refuse)
    assert main(["presets"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "/some/where/file" in err and "Traceback" not in err, err


def test_an_unknown_os_error_without_a_path_keeps_its_traceback(monkeypatch):
    from blockloop.cli import presets

    def fail(args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(presets, "run", fail)
    with pytest.raises(OSError):
        main(["presets"])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc, where nothing can be created")
def test_an_out_folder_that_cannot_be_created_is_one_line(capsys):
    assert main(["train", "--preset", "tiny", "--steps", "2", "--device", "cpu", "--out", "/proc/blockloop-test",
                 "--no-progress"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "/proc/blockloop-test" in err and "Traceback" not in err, err


def test_a_write_that_cannot_happen_names_its_target_not_the_temporary_and_can_be_checked_first(tmp_path):
    from blockloop.files import check_writable

    folder = tmp_path / "results.json"
    folder.mkdir()
    for write in (lambda p: atomic_write_text(p, "{}"), check_writable):
        with pytest.raises(IsADirectoryError) as caught:
            write(folder)
        assert caught.value.filename == str(folder)
        blocked = tmp_path / "a_file" / "x.json"  # a file where its folder belongs
        (tmp_path / "a_file").write_text("")
        with pytest.raises(OSError) as caught:
            write(blocked)
        assert caught.value.filename == str(blocked)
    before = sorted(tmp_path.iterdir())
    check_writable(tmp_path / "new" / "deeper" / "ok.json")
    assert sorted(tmp_path.iterdir()) == before  # the probe leaves nothing behind, not even the folders to be made
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anywhere
        with pytest.raises(PermissionError) as caught:  # judged at the nearest folder that exists
            check_writable(tmp_path / "ro" / "new" / "x.json")
        assert caught.value.filename == str(tmp_path / "ro" / "new" / "x.json")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_write_goes_through_a_link_and_never_replaces_a_pipe_or_device(tmp_path):
    """Renaming a new file over a path replaced a symbolic link by a file (its target went stale) and a pipe or a
    device by a file: `eval --out /dev/null` run as root would have replaced the system's /dev/null."""
    from blockloop.errors import BlockloopError
    from blockloop.files import check_writable

    target, link = tmp_path / "shared" / "results.json", tmp_path / "results.json"
    target.parent.mkdir()
    target.write_text("old")
    link.symlink_to(target)
    check_writable(link)
    atomic_write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    target.chmod(0o640)  # a file replaced keeps its permissions; one read-only to its writer is refused
    atomic_write_text(target, "newer")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640 and target.read_text() == "newer"
    if os.geteuid() != 0:  # root writes anything
        target.chmod(0o440)
        for write in (lambda p: atomic_write_text(p, "{}"), check_writable):
            with pytest.raises(PermissionError):
                write(target)
        assert target.read_text() == "newer"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for write in (lambda p: atomic_write_text(p, "{}"), check_writable):
        with pytest.raises(BlockloopError, match="is not a regular file"):
            write(fifo)
        assert stat.S_ISFIFO(fifo.stat().st_mode)


@pytest.mark.parametrize("target", ["weights", "recursive", "hf"])
def test_a_conversion_appears_whole_or_not_at_all(tmp_path_factory, monkeypatch, target):
    """Every file of a conversion is written into a hidden folder beside --out, renamed to --out last: while it
    writes (and after a failed write) --out does not exist, so a killed conversion never leaves a folder that
    looks like a model; --out may be an empty folder but never one holding something else."""
    from blockloop.convert.checkpoints import convert_checkpoint
    from blockloop.errors import BlockloopError
    from blockloop.train import checkpoint as ckpt
    from server_helpers import tiny_run

    if target == "hf":
        transformers = pytest.importorskip("transformers")
        owner, name = transformers.PreTrainedModel, "save_pretrained"
    else:
        owner, name = ckpt, "write_json_atomic"  # the last file of a blockloop checkpoint
    run = tiny_run(tmp_path_factory.getbasetemp() / "atomic-conversions", "tiny")
    options = {"loops": 2} if target == "recursive" else {}
    out = tmp_path_factory.mktemp(target) / "out"
    write = getattr(owner, name)

    def write_then_fail(*args, **kwargs):
        assert not out.exists() and [p.name[:9] for p in out.parent.iterdir()] == [".out.tmp-"]  # beside --out
        write(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(owner, name, write_then_fail)
    with pytest.raises(OSError, match="No space left"):
        convert_checkpoint(target, run, out, **options)
    assert list(out.parent.iterdir()) == []  # neither --out nor the partial folder
    monkeypatch.undo()
    out.mkdir()  # an empty folder is taken
    assert convert_checkpoint(target, run, out, **options).out == out and list(out.parent.iterdir()) == [out]
    elsewhere = out.parent / "other"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    with pytest.raises(BlockloopError, match="other already exists and is not empty; choose another directory"):
        convert_checkpoint(target, run, elsewhere, **options)
    assert [p.name for p in elsewhere.iterdir()] == ["notes.txt"]
