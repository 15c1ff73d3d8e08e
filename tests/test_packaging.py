"""The lower bounds in pyproject.toml are the ones a test run checked: tests/oldest_versions.txt pins the oldest
releases that install together and pass the suite, and every pin must lie inside pyproject's ranges (a bound raised
without the file, or a pin left below a new bound, fails here)."""
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def declared() -> dict[str, Requirement]:
    import tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["dev"]
    return {Requirement(r).name.lower(): Requirement(r) for r in reqs}


def pins() -> dict[str, Version]:
    out = {}
    for line in (REPO / "tests" / "oldest_versions.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[name.strip().lower()] = Version(version.strip())
    return out


def test_every_pin_is_a_declared_dependency_inside_its_range():
    reqs, oldest = declared(), pins()
    assert oldest, "no pins"
    for name, version in oldest.items():
        assert name in reqs, f"{name} is pinned but not a dependency"
        assert reqs[name].specifier.contains(version), f"{name}=={version} is outside {reqs[name]}"


def test_every_lower_bound_has_a_pin():
    oldest = pins()
    bounded = {name for name, req in declared().items() if any(s.operator == ">=" for s in req.specifier)}
    assert bounded - set(oldest) == set()


def test_the_pins_are_the_lower_bounds_where_they_can_be():
    """Each pin equals its package's lower bound, except gradio: its oldest release that installs beside
    transformers' oldest allowed release is newer than the oldest the dashboard works with (6.0)."""
    reqs, oldest = declared(), pins()
    for name, version in oldest.items():
        lows = [Version(s.version) for s in reqs[name].specifier if s.operator == ">="]
        assert len(lows) == 1, f"{name}: one >= bound expected in {reqs[name]}"
        if name == "gradio":
            assert version > lows[0]
        else:
            assert version == lows[0], f"{name}: pinned {version}, declared {reqs[name]}"   # 4 == 4.0.0


def test_an_older_transformers_is_refused_at_run_time(monkeypatch):
    """pip enforces the bound, but an environment assembled otherwise (--no-deps, another package manager) must not
    decode with a transformers that ignores the cache argument: one error naming the fix, before any forward."""
    import importlib.metadata

    from core_helpers import tiny_target
    from domino_lab.errors import UserError
    from domino_lab.target import OLDEST_TRANSFORMERS, check_transformers, installed_transformers

    bound = next(s.version for s in declared()["transformers"].specifier if s.operator == ">=")
    assert Version(OLDEST_TRANSFORMERS) == Version(bound)
    check_transformers()                                          # the installed release passes
    with pytest.raises(UserError, match=r"transformers 5\.22\.0 is installed; .* pip install 'transformers>=5\.25"):
        check_transformers("5.22.0")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.24.0" if name == "transformers" else real(name))
    installed_transformers.cache_clear()                          # read once per process: forget the real one
    with pytest.raises(UserError, match="5.24.0 is installed"):
        tiny_target()
    installed_transformers.cache_clear()
