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

