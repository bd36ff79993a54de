"""Kernels' tests without a GPU: a child script run under Triton's interpreter (TRITON_INTERPRET=1 must be set
before triton is imported, hence a process of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def interpreted_json(child: str, cases, **env: str):
    """Run `child` (Python source) with `cases` as JSON in argv[1] under the interpreter, `env` added to the
    environment; returns the JSON of the last line it prints."""
    run = subprocess.run([sys.executable, "-c", child, json.dumps(cases)], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1", **env), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
