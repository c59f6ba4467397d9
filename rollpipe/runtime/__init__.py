"""The one concurrency model: an event loop in a thread (``Runtime``), the scoped bridge to it
from other threads (``Scope``), and waits that wake instead of polling (``Gate``, ``Signal``).
See docs/architecture.md."""

from rollpipe.runtime.feed import Feed
from rollpipe.runtime.loop import Runtime, RuntimeClosedError, Scope
from rollpipe.runtime.sync import Gate, Listeners, Signal, fresh_error

__all__ = [
    "Feed",
    "Gate",
    "Listeners",
    "Runtime",
    "RuntimeClosedError",
    "Scope",
    "Signal",
    "fresh_error",
]
