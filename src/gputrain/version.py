"""The package version (pyproject.toml has the same), where the reports and the CLI read it."""

__version__ = "0.1.0"
