"""Where a command may write: never onto, into or around one of its own inputs.

A command writes its output through work paths beside it (`<out>.partial-*`, built then renamed
into place; `<out>.old-*`, the replaced output until it is removed) and, with --force, removes what
is there. So an output that is, contains or lies inside an input, or an input that sits at one of
those work paths, would be overwritten or deleted: it is refused before anything is written.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from smoe.errors import SmoeError

WORK_PATHS = (".partial-", ".old-", ".lock")  # `<out><marker><anything>` beside an output is the command's to remove


def check_outputs(outputs, inputs) -> None:
    """A SmoeError when an output or its work paths would be, contain or lie inside an input (None
    inputs are skipped); symlinks are resolved, so a link to an input is that input."""
    sources = [(given, Path(given).resolve()) for given in inputs if given is not None]
    for out in outputs:
        for given, source in sources:
            relation = _relation(Path(out), source)
            if relation:
                raise SmoeError(f"{out}: the output{relation} the input {given}; a command never replaces its "
                                f"own input (choose another output path)")


def _relation(out: Path, source: Path) -> str | None:
    """How writing `out` would touch `source`, in words that follow "the output", or None."""
    target = out.resolve()
    if target == source:
        return " is"
    if target in source.parents:
        return " contains"
    if source in target.parents:
        return " lies inside"
    parent = Path(os.path.abspath(out)).parent.resolve()
    work = [p for p in (source, *source.parents) if p.parent == parent and _is_work_name(p.name, out.name)]
    linked = [p for p in _existing_work_paths(parent, out.name) if _overlaps(p.resolve(), source)]
    if work or linked:
        return f"'s work path {(work or linked)[0].name} (made and removed beside it) is or holds"
    return None


def _is_work_name(name: str, out_name: str) -> bool:
    return any(name.startswith(out_name + marker) for marker in WORK_PATHS)


def _existing_work_paths(parent: Path, out_name: str) -> list[Path]:
    """Work paths already there, which may be symlinks to anywhere."""
    return [p for marker in WORK_PATHS for p in parent.glob(f"{_glob_escape(out_name)}{marker}*")]


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


@contextmanager
def output_lock(out: Path, command: str):
    """One writer per output at a time: an exclusive lock on `<out>.lock` beside it, which says who
    holds it. A second writer is refused at once, naming the holder; the lock goes with its holder,
    also when the holder is killed (the kernel releases it)."""
    if not out.parent.is_dir():
        raise SmoeError(f"{out.parent}: no such directory (the output's parent must exist)")
    path = out.parent / f"{out.name}.lock"
    fd = _locked(path, out, command)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"smoe {command}, pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}"
              .encode(), 0)
    try:
        yield
    finally:
        os.unlink(path)
        os.close(fd)


def _locked(path: Path, out: Path, command: str) -> int:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another smoe process"
            os.close(fd)
            raise SmoeError(f"{out}: {holder} is writing it; wait for it to finish or stop it") from None
        if path.exists() and path.stat().st_ino == os.fstat(fd).st_ino:
            return fd
        os.close(fd)  # the previous holder removed the file between our open and our lock: lock the new one


def publish(partial: Path, out: Path) -> None:
    """Rename a finished output (vault, export) into place; an old one (--force) is removed only after that."""
    old = None
    if out.exists():
        old = out.parent / f"{out.name}.old-{partial.name.rsplit('-', 1)[-1]}"
        out.rename(old)
    partial.rename(out)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
