"""Ships the experiment templates and notebooks inside the wheel, as ``det_lab/_templates`` and
``det_lab/_notebooks`` (package data mapped from the repository's top-level directories, which a
checkout uses as they are). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

DATA_DIRS = {"det_lab._templates": "experiment_templates", "det_lab._notebooks": "notebooks"}
# `**/*` skips dotfiles (glob), hence .detignore by name
DATA_FILES = ["**/*", "**/.detignore"]

setup(
    packages=find_packages(include=["det_lab", "det_lab.*"]) + list(DATA_DIRS),
    package_dir=DATA_DIRS,
    package_data={name: DATA_FILES for name in DATA_DIRS},
    exclude_package_data={name: ["**/__pycache__/*", "**/*.pyc"] for name in DATA_DIRS},
)
