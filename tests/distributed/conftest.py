"""The tests past one process: Ray clusters of several nodes on one machine, episode
workers, node and worker faults, a driver killed with SIGKILL, weights sent by broadcast,
a vLLM OpenAI server process (``ServerEngine``) and ``rollpipe run`` with engines in their
own processes.

They run in their own session (``nox -s distributed``, which sets
``ROLLPIPE_DISTRIBUTED=1``) so the main test session stays under its time budget; the
main session does not collect them at all (no skipped tests), as ``tests/vision`` and
``tests/compat`` do.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("ROLLPIPE_DISTRIBUTED") == "1" else ["test_*.py"]
