"""`smoe export`: a vault written for another runtime (GGUF for llama.cpp, MLX for mlx-lm), atomically:
built beside the output under a partial name, published by one rename."""

from __future__ import annotations

from pathlib import Path

from smoe.errors import SmoeError
from smoe.export.source import ExportSource
from smoe.format.output import writing

FORMATS = ("gguf", "mlx")


def export(vault_dir, to: str, output, force: bool = False, **options) -> Path:
    """Write VAULT as `to` ("gguf": one file, "mlx": a directory) at `output`, atomically."""
    if to not in FORMATS:
        raise SmoeError(f"unknown export format {to!r} (gguf, mlx)")
    with writing(output, "export", [vault_dir], force, kind="file" if to == "gguf" else "dir") as out:
        write_export(vault_dir, to, out, options)
    return out.path


def write_export(vault_dir, to: str, out, options: dict) -> None:
    source = ExportSource(vault_dir)
    if to == "gguf":
        from smoe.export.gguf import write_gguf as write
    else:
        from smoe.export.mlx import write_mlx as write
    try:
        write(source, out.begin(make="file" if to == "gguf" else None), **options)  # write_mlx makes its directory
        out.publish()
    finally:
        source.close()
