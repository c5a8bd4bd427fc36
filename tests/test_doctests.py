"""Every docstring example in fshard (and fshard.transforms) runs and is right."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import fshard
import fshard.transforms


def _modules():
    names = []
    for pkg in (fshard, fshard.transforms):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.endswith("launch") or ".distributed" in info.name:
                continue  # needs a launcher job; covered by tests/test_launch.py
            names.append(info.name)
    return sorted(set(names) | {"fshard"})


@pytest.mark.parametrize("name", _modules())
def test_doctests(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"
