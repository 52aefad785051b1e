"""lanefuse's version as installed (the report's header, `--version`): the package metadata's, or a word that says
the source tree was never installed."""

from __future__ import annotations


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("lanefuse")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"
