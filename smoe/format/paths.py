"""Where a command may write: never onto, into or around one of its own inputs.

A command writes its output through work paths beside it (`<out>.partial-*`, built then renamed
into place; `<out>.old-*`, the replaced output until it is removed) and, with --force, removes what
is there. So an output that is, contains or lies inside an input, or an input that sits at one of
those work paths, would be overwritten or deleted: it is refused before anything is written.
"""

from __future__ import annotations

import os
from pathlib import Path

from smoe.errors import SmoeError

WORK_PATHS = (".partial-", ".old-", ".lock")  # `<out><marker><anything>` beside an output is the command's to remove


def check_outputs(outputs, inputs) -> None:
    """A SmoeError when an output or its work paths would be, contain or lie inside an input (None
    inputs are skipped); symlinks are resolved, so a link to an input is that input."""
    sources = [(given, Path(given).resolve()) for given in inputs if given is not None]
    for out in outputs:
        if not str(out).strip():  # Path("") is ".", the directory the command runs in
            raise SmoeError("the output path is empty (give -o PATH)")
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
    return [p for marker in WORK_PATHS for p in parent.glob(f"{glob_escape(out_name)}{marker}*")]


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
