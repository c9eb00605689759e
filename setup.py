"""Ships the experiment templates and notebooks inside the wheel, as ``det_lab/_templates`` and
``det_lab/_notebooks`` (package data mapped from the repository's top-level directories, which a
checkout uses as they are). Everything else is in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup

DATA_DIRS = {"det_lab._templates": "experiment_templates", "det_lab._notebooks": "notebooks"}
# `**/*` skips dotfiles (glob), hence .detignore by name
DATA_FILES = ["**/*", "**/.detignore"]


def _data_packages() -> list[str]:
    """Each data directory and every folder below it, as the packages setuptools would otherwise
    warn about one by one ("... is absent from the packages configuration")."""
    out = []
    for name, src in DATA_DIRS.items():
        out.append(name)
        for d in sorted(Path(src).rglob("*")):
            if d.is_dir() and not any(p.startswith((".", "__pycache__")) for p in d.relative_to(src).parts):
                out.append(".".join([name, *d.relative_to(src).parts]))
    return out


DATA_PACKAGES = _data_packages()

setup(
    packages=find_packages(include=["det_lab", "det_lab.*"]) + DATA_PACKAGES,
    package_dir=DATA_DIRS,
    package_data={name: DATA_FILES for name in DATA_PACKAGES},
    exclude_package_data={name: ["**/__pycache__/*", "**/*.pyc"] for name in DATA_PACKAGES},
)
