"""The package version (one home: the package, the backend's cache salt and pyproject.toml agree)."""

__version__ = "0.1.0"
