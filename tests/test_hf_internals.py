"""The transformers internals smoe.hf lists are present in the installed release (that nothing else of
smoe reaches into transformers is an import contract in pyproject.toml, checked by `make test`)."""

from pathlib import Path

import transformers
from packaging.version import Version

from smoe.hf import internals

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_transformers_internal_resolves_in_the_installed_release():
    assert internals.missing() == [], f"transformers {transformers.__version__} moved these"


def test_every_listed_user_of_an_internal_exists():
    for entry in internals.INTERNALS:
        assert callable(internals.resolve(entry.used_by)), entry.used_by


def test_the_installed_transformers_is_in_the_supported_range():
    floor = Version(internals.SUPPORTED.removeprefix(">="))
    assert Version(transformers.__version__) >= floor
    assert f'"transformers{internals.SUPPORTED}"' in (ROOT / "pyproject.toml").read_text()



def test_transformers_module_layout_is_read_only_inside_smoe_hf():
    """No attribute of transformers' decoder-layer layout (internals.MODULE_LAYOUT) is read outside smoe/hf,
    so the runtime's decoders get their tensors through smoe.hf.trunk (names read from the syntax tree)."""
    import ast

    found = []
    for path in sorted((ROOT / "smoe").rglob("*.py")):
        if path.relative_to(ROOT / "smoe").parts[0] == "hf":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in internals.MODULE_LAYOUT:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert found == []
