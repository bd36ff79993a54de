"""`smoe export`: a vault written for another runtime (GGUF for llama.cpp, MLX for mlx-lm), atomically:
built beside the output under a partial name, published by one rename."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from smoe.errors import SmoeError
from smoe.export.source import ExportSource
from smoe.format.paths import check_outputs, output_lock, publish

FORMATS = ("gguf", "mlx")


def export(vault_dir, to: str, output, force: bool = False, **options) -> Path:
    """Write VAULT as `to` ("gguf": one file, "mlx": a directory) at `output`, atomically."""
    check_outputs([output], [vault_dir])
    if to not in FORMATS:
        raise SmoeError(f"unknown export format {to!r} (gguf, mlx)")
    out = Path(output)
    with output_lock(out, "export"):
        if out.exists() and not force:
            raise SmoeError(f"{out}: already exists (use --force to replace it)")
        write_export(vault_dir, to, out, options)
    return out


def write_export(vault_dir, to: str, out: Path, options: dict) -> None:
    source = ExportSource(vault_dir)
    if to == "gguf":
        from smoe.export.gguf import write_gguf as write
    else:
        from smoe.export.mlx import write_mlx as write
    partial = out.parent / f"{out.name}.partial-{os.getpid()}"
    remove(partial)
    try:
        write(source, partial, **options)
        publish(partial, out)
    finally:
        remove(partial)
        source.close()


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
