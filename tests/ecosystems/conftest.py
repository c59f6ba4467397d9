"""Each ecosystem's tests run only where its package is installed (its own nox session:
``nox -s gem``, ``reasoning-gym``, ``textarena``, ``openenv``, ``verifiers``).

The main test session does not install them, so there these modules are not collected at
all (no skipped tests), as ``tests/compat`` does for verl.
"""

from __future__ import annotations

import importlib.util

PACKAGES = {
    "test_gem.py": "gem",
    "test_reasoning_gym.py": "reasoning_gym",
    "test_textarena.py": "textarena",
    "test_openenv.py": "openenv",
    "test_verifiers.py": "verifiers.v1",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


collect_ignore = [test for test, module in PACKAGES.items() if not _installed(module)]
