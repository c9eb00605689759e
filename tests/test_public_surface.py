"""det_lab's public surface (det_lab/public.py) against the one recorded at the last release: what a
lab's trials, notebooks and scripts use keeps working, or is deprecated first."""

from __future__ import annotations

import copy
import importlib
import json
import sys
import warnings

import pytest

import det_lab
from det_lab.public import DEPRECATED, PYTHON
from tests import surface


def _released() -> dict:
    recorded = sorted(surface.FIXTURES.glob("*.json"), key=lambda p: tuple(map(int, p.stem.split("."))))
    assert recorded, "no release has recorded its surface (python -m tests.surface --write)"
    return json.loads(recorded[-1].read_text())


@pytest.fixture(scope="module")
def now() -> dict:
    return surface.current()


def test_this_release_recorded_its_surface():
    assert (surface.FIXTURES / f"{det_lab.__version__}.json").is_file(), (
        f"det_lab {det_lab.__version__} has no recorded surface: run python -m tests.surface --write")


def test_nothing_released_is_gone_or_changed_without_a_deprecation(now):
    assert surface.breaks(_released(), now) == []


def test_the_check_sees_a_removed_name_a_changed_signature_an_option_and_a_config_key(now):
    changed = copy.deepcopy(now)
    del changed["python"]["det_lab.formats.split_episodes"]
    init = changed["python"]["det_lab.core.init"]["params"]
    init.append(["required_now", "KEYWORD_ONLY", False])
    changed["python"]["det_lab.data.pull"]["params"] = [
        p for p in changed["python"]["det_lab.data.pull"]["params"] if p[0] != "settings"]
    changed["cli"]["det-lab data pull"].remove("--json") if "--json" in changed["cli"]["det-lab data pull"] else None
    changed["config"]["lab"].remove("data_root")
    problems = surface.breaks(now, changed)
    assert "det_lab.formats.split_episodes: removed" in problems
    assert "det_lab.core.init: new parameter 'required_now' has no default" in problems
    assert any(p.startswith("det_lab.data.pull: parameter 'settings'") for p in problems)
    assert "lab config key data_root: no longer accepted" in problems
    # an added name, option or defaulted parameter is not a break
    grown = copy.deepcopy(now)
    grown["python"]["det_lab.core.init"]["params"].append(["new_option", "KEYWORD_ONLY", True])
    grown["cli"]["det-lab run"].append("--new-flag")
    assert surface.breaks(now, grown) == []


def test_every_declared_public_name_exists():
    for module, names in PYTHON.items():
        mod = importlib.import_module(module)
        assert [n for n in names if not hasattr(mod, n)] == [], module


def test_each_deprecated_spelling_still_works_and_names_its_replacement_and_removal(now):
    for old, dep in DEPRECATED.items():
        assert tuple(map(int, dep.removal.split("."))) > tuple(map(int, det_lab.__version__.split("."))), old
        if old.startswith("det-lab "):
            command, option = old.rsplit(" ", 1)
            assert option in now["cli"][command], f"{old} no longer accepted before {dep.removal}"
            continue
        for name in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
            del sys.modules[name]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            importlib.import_module(old)
        (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert dep.new in str(warning.message) and dep.removal in str(warning.message)
