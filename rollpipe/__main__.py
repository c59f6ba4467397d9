"""``python -m rollpipe`` is the ``rollpipe`` command."""

from rollpipe.cli import main

raise SystemExit(main())
