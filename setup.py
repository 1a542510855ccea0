"""Packages found, not listed: every package under ``aotc/`` by setuptools' own discovery, and the
two folders installed under it from their own place (``cache/`` as ``aotc.cache``, ``cli/`` as
``aotc.cli``, with any subpackage they grow). Everything else is in ``pyproject.toml``."""

from setuptools import find_packages, setup

# folder -> the dotted name it installs as (pyproject.toml's package-dir says the same)
MAPPED = {"cache": "aotc.cache", "cli": "aotc.cli"}


def packages() -> list[str]:
    """Every package the wheel holds: a module added in any folder is in it the day it is written."""
    found = find_packages(include=["aotc", "aotc.*"])
    for folder, dotted in MAPPED.items():
        found += [dotted] + [f"{dotted}.{sub}" for sub in find_packages(folder)]
    return sorted(found)


setup(packages=packages())
