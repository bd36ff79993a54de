"""The package version, in one place for the vault header, the CLI and packaging."""

__version__ = "0.1.0"
