"""The one way a command writes its output: check the output against the inputs, lock it, refuse an
existing one unless --force, build it under a partial name beside it, publish it by a rename, clean up.

Work paths beside an output `OUT`: `OUT.lock` (who writes it), `OUT.partial-<pid>` (a temporary build)
or `OUT.partial-<fingerprint>` (a resumable one), `OUT.old-<pid>` (the replaced output until it is
removed). A work path is removed only under the lock, only when the process named in it is dead, and
only when smoe could have made it: a directory, or a regular file with one link, owned by the user.
Anything else there (a symlink, a hard link, another user's file) is refused in one line: a writer
never follows a link it did not make, never truncates a file it did not create, and never removes an
input, also one reached through a mount or a hard link, nor anything across a mount point.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

from smoe.errors import SmoeError
from smoe.format.paths import WORK_PATHS, check_outputs, glob_escape

PARTIAL, OLD, LOCK = WORK_PATHS
INPUT_WALK_LIMIT = 100_000  # entries of an input's subtree compared against what would be removed
PID_MAX = 1 << 22  # Linux's largest pid: a longer number is a fingerprint, not a writer


@contextmanager
def writing(out, command: str, inputs: Iterable, force: bool = False, kind: str = "dir"):
    """Hold `out` for one writer: yields an `Output` to `begin` a partial in and `publish`. On an
    exception (Ctrl-C included) a temporary partial is removed and a resumable one kept if worth it.
    `kind`: the output is a "dir" or a "file" (what --force may replace, `check_replaceable`)."""
    inputs = [i for i in inputs if i is not None]
    check_outputs([out], inputs)
    output = Output(Path(out), inputs, force, kind)
    with output_lock(output.path, command):
        output.check()
        try:
            yield output
        except BaseException:
            try:
                output.discard()
            except (OSError, SmoeError):  # the failure itself is what to report; a rerun removes the partial
                pass
            raise


class Output:
    """An output being written, under its lock (see `writing`)."""

    def __init__(self, path: Path, inputs: list, force: bool, kind: str = "dir"):
        self.path, self.force, self.kind = path, force, kind
        self.guard = Guard(inputs)
        self.partial: Path | None = None
        self.keep: Callable[[Path], bool] | None = None
        self.published = False

    def check(self) -> None:
        """Before anything is written: the output is new or --force replaces it, and every stale work
        path and the output to replace can be removed without touching an input or crossing a mount."""
        if os.path.lexists(self.path) and not self.force:
            raise SmoeError(f"{self.path}: already exists (use --force to replace it)")
        for work in self.stale(PARTIAL) + self.stale(OLD):
            check_ours(work)
            self.guard.sweep(work, remove=False)
        if os.path.lexists(self.path):
            self.guard.sweep(self.path, remove=False)
            check_replaceable(self.path, self.kind)

    def partial_path(self, tag: str | None = None) -> Path:
        """`OUT.partial-<tag>` for a resumable build, else `OUT.partial-<pid>`."""
        return self.path.parent / f"{self.path.name}{PARTIAL}{tag or os.getpid()}"

    def begin(self, tag: str | None = None, make: str | None = None, keep: Callable[[Path], bool] | None = None) -> Path:
        """Remove the stale work paths and start the partial: with `tag` a resumable directory (kept
        and resumed unless --force; `keep` says whether one left by a failure is worth resuming), else
        a temporary one, made here as an empty "dir" or "file" (`make`), or left for the writer to make."""
        if tag is not None and not FINGERPRINT.match(tag):
            raise ValueError(f"a resumable partial's tag comes from resumable_tag(), not {tag!r}")
        partial = self.partial_path(tag)
        resume = tag is not None and not self.force and os.path.isdir(partial) and not os.path.islink(partial)
        for work in self.stale(PARTIAL) + self.stale(OLD):
            if not (resume and work == partial):
                check_ours(work)
                self.guard.sweep(work, remove=True)
        if tag is not None and not resume:
            os.mkdir(partial)
        elif make == "dir":
            os.mkdir(partial)  # never follows a link planted there
        elif make == "file":
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        self.partial, self.keep = partial, keep
        return partial

    def publish(self) -> None:
        """Rename the finished partial into place; the output it replaces (--force) goes only after that."""
        old = None
        if os.path.lexists(self.path) and not self.force:
            raise SmoeError(f"{self.path}: appeared while the output was written; nothing replaced (use --force "
                            f"to replace it)")
        if os.path.lexists(self.path):
            old = self.path.parent / f"{self.path.name}{OLD}{os.getpid()}"
            if os.path.lexists(old):
                raise SmoeError(f"{old}: appeared while the output was written; remove it and run again")
            os.rename(self.path, old)
        try:
            os.rename(self.partial, self.path)
        except OSError:
            if old is not None:
                os.rename(old, self.path)
            raise
        self.published = True
        if old is not None:
            try:
                self.guard.sweep(old, remove=True)
            except (OSError, SmoeError) as e:
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                raise SmoeError(f"{self.path}: written, but the output it replaced could not be removed and is "
                                f"left at {old} ({why})") from None

    def discard(self) -> None:
        """After a failure: the partial goes, unless it is resumable and `keep` finds it worth resuming."""
        partial = self.partial
        if partial is None or self.published or not os.path.lexists(partial):
            return
        if self.keep is not None and self.keep(partial):
            return
        self.guard.sweep(partial, remove=True)

    def stale(self, marker: str) -> list[Path]:
        """This output's work paths of one kind whose writer is gone: under the lock, every one but
        those named for a live process (a resumable partial names none: its writer held the lock)."""
        prefix = self.path.name + marker
        found = sorted(self.path.parent.glob(glob_escape(prefix) + "*"))
        return [p for p in found if is_work_suffix(p.name[len(prefix):], marker)
                and not is_alive(writer_pid(p.name[len(prefix):]))]


TAG_HEX = 16  # a resumable partial is named by the first 16 hex digits of its writer's fingerprint
FINGERPRINT = re.compile(rf"[0-9a-f]{{{TAG_HEX}}}\Z")


def resumable_tag(digest: str) -> str:
    """The name a resumable partial takes from a hex digest of what determines its content: the one form
    `is_work_suffix` recognises, so a stale one is cleaned up and a user's own `OUT.partial-*` never is."""
    tag = digest[:TAG_HEX]
    if not FINGERPRINT.match(tag):
        raise ValueError(f"not a hex digest of at least {TAG_HEX} digits: {digest!r}")
    return tag


def is_work_suffix(suffix: str, marker: str) -> bool:
    """Only names smoe gives are work paths: `OUT.old-<pid>`, `OUT.partial-<pid>`, `OUT.partial-<fingerprint>`;
    `OUT.old-keep` is the user's own copy, neither removed nor refused."""
    return writer_pid(suffix) is not None or (marker == PARTIAL and FINGERPRINT.match(suffix) is not None)


def writer_pid(suffix: str) -> int | None:
    return int(suffix) if suffix.isdigit() and 0 < int(suffix) < PID_MAX else None


def is_alive(pid: int | None) -> bool:
    if pid is None or pid == os.getpid():  # no writer named, or this process's own: it holds the lock now
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def check_replaceable(path: Path, kind: str) -> None:
    """--force replaces an earlier output of the same kind, not whatever is at the path: a file output (a GGUF)
    a file or a link, a directory output (a vault, a checkpoint, an MLX model) a link or a directory that is
    empty or holds the config.json each of them has. A directory of other files, or a device, is refused."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return  # the link goes, never what it points at
    if stat.S_ISDIR(st.st_mode):
        if kind == "file":
            why = "a directory, and the output is one file"
        elif os.listdir(path) and not os.path.isfile(path / "config.json"):
            why = "a directory without a config.json, so no output smoe writes"
        else:
            return
    elif not stat.S_ISREG(st.st_mode):
        why = "neither a file nor a directory"
    elif kind == "dir":
        why = "a file, and the output is a directory"
    else:
        return
    raise SmoeError(f"{path}: {why}; --force replaces only an earlier output of the same kind (remove it yourself "
                    f"or choose another output path)")


def check_ours(path: Path) -> None:
    """A stale work path is removed only if smoe could have made it; anything else is refused."""
    what = not_ours(os.lstat(path))
    if what:
        raise SmoeError(f"{path}: {what}, not a work path smoe made; remove it yourself or choose another output")


def not_ours(st: os.stat_result) -> str | None:
    """Why a file smoe may take over or remove is not one it made, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        return "neither a file nor a directory"
    if st.st_uid != os.geteuid():
        return f"owned by another user (uid {st.st_uid})"
    if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
        return f"a file with {st.st_nlink} hard links"
    return None


class Guard:
    """What a removal may not touch: the inputs (by device and inode, so a mount or a hard link of one
    is seen) and anything across a mount point."""

    def __init__(self, inputs: list):
        self.inputs = input_inodes(inputs)
        self.mounts = mount_points()

    def sweep(self, path: Path, remove: bool) -> None:
        """Walk `path` without following links, refusing an input or a mount point anywhere in it;
        with `remove`, delete it (children first)."""
        real = os.path.join(os.path.realpath(path.parent), path.name)
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._sweep(parent, path.name, real, None, remove)
        finally:
            os.close(parent)

    def _sweep(self, dir_fd: int, name: str, shown: str, device: int | None, remove: bool) -> None:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        self._check(shown, st, device)
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != (st.st_dev, st.st_ino):
                    raise SmoeError(f"{shown}: replaced while smoe was removing it; nothing more removed")
                with os.scandir(fd) as entries:
                    names = [e.name for e in entries]
                for child in names:
                    self._sweep(fd, child, os.path.join(shown, child), st.st_dev, remove)
            finally:
                os.close(fd)
            if remove:
                os.rmdir(name, dir_fd=dir_fd)
        elif remove:
            os.unlink(name, dir_fd=dir_fd)

    def _check(self, shown: str, st: os.stat_result, device: int | None) -> None:
        given = self.inputs.get((st.st_dev, st.st_ino))
        if given is not None:
            raise SmoeError(f"{shown}: would be removed, but it is the input {given} (reached through a mount or a "
                            f"hard link); a command never removes its own input (choose another output path)")
        if (device is not None and st.st_dev != device) or shown in self.mounts:
            raise SmoeError(f"{shown}: a mount point inside what would be removed; smoe never removes across a "
                            f"mount (unmount it or choose another output path)")


def input_inodes(inputs: list) -> dict[tuple[int, int], str]:
    """(st_dev, st_ino) -> input as given, for every input, its subtree and what links there point at."""
    found: dict[tuple[int, int], str] = {}
    for given in inputs:
        try:
            st = os.stat(given)
        except OSError:
            continue
        found.setdefault((st.st_dev, st.st_ino), str(given))
        pending = [os.fspath(given)] if stat.S_ISDIR(st.st_mode) else []
        seen = 0
        while pending and seen < INPUT_WALK_LIMIT:
            try:
                with os.scandir(pending.pop()) as entries:
                    for e in entries:
                        seen += 1
                        for follow in (False, True) if e.is_symlink() else (False,):
                            try:
                                s = e.stat(follow_symlinks=follow)
                            except OSError:
                                continue
                            found.setdefault((s.st_dev, s.st_ino), str(given))
                        if e.is_dir(follow_symlinks=False):
                            pending.append(e.path)
            except OSError:
                continue
    return found


def mount_points() -> set[str]:
    """Every mount point this process sees (Linux's mountinfo; elsewhere the device check alone)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return set()
    unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), s)
    return {unescape(line.split()[4]) for line in lines if len(line.split()) > 4}


@contextmanager
def output_lock(out: Path, command: str):
    """One writer per output at a time: an exclusive lock on `<out>.lock` beside it, which says who
    holds it. A second writer is refused at once, naming the holder; the lock goes with its holder,
    also when the holder is killed (the kernel releases it), and a stale one is taken over only if it
    is a plain file of this user's."""
    if not out.parent.is_dir():
        raise SmoeError(f"{out.parent}: no such directory (the output's parent must exist)")
    path = out.parent / f"{out.name}{LOCK}"
    fd = locked(path, out)
    os.ftruncate(fd, 0)  # a file this process created, or checked to be a stale lock of this user's
    os.pwrite(fd, f"smoe {command}, pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}"
              .encode(), 0)
    try:
        yield
    finally:
        if same_file(path, fd):  # never remove a file that replaced ours
            os.unlink(path)
        os.close(fd)


def locked(path: Path, out: Path) -> int:
    """An open, exclusively locked descriptor of the lock file at `path`, which is still that file."""
    while True:
        fd, created = open_lock(path)
        if fd is None:
            continue  # removed between our tries: make it again
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):  # a live holder is named even when it is another user
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another smoe process"
            os.close(fd)
            raise SmoeError(f"{out}: {holder} is writing it; wait for it to finish or stop it") from None
        what = None if created else not_ours(os.fstat(fd))  # made here: ours whatever owner root_squash shows
        if what:
            os.close(fd)
            raise SmoeError(f"{path}: {what}, not a lock smoe made; remove it yourself or choose another output")
        if same_file(path, fd):
            return fd
        os.close(fd)  # the previous holder removed the file between our open and our lock: lock the new one


def open_lock(path: Path) -> tuple[int | None, bool]:
    """(descriptor, whether this call created the file): the lock file made anew, or the one there opened
    without following a link; no descriptor if it vanished."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        pass
    try:
        return os.open(path, flags), False
    except FileNotFoundError:
        return None, False
    except OSError as e:  # a symlink (ELOOP), a directory (EISDIR), another user's file (EACCES)
        what = "a symlink" if os.path.islink(path) else "a directory" if os.path.isdir(path) else e.strerror
        raise SmoeError(f"{path}: {what}, not a lock smoe made; remove it yourself or choose another output") from None


def same_file(path: Path, fd: int) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def kept_partial(out) -> Path | None:
    """A resumable partial left beside `out` (what an interrupted quantize leaves to resume), or None."""
    out = Path(out)
    prefix = out.name + PARTIAL
    for p in sorted(out.parent.glob(glob_escape(prefix) + "*")):
        if writer_pid(p.name[len(prefix):]) is None and p.is_dir() and not p.is_symlink():
            return p
    return None
