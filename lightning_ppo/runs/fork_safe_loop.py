"""An event loop whose sockets a forked child cannot take from the parent.

After a fork, parent and child share the kernel's list of watched sockets (one epoll object, keyed
by the same file descriptors). A child that closes one of the parent's connections (a client the
user's reward holds, a pooled session it lets go of) removes that socket from the shared list, and
the parent's loop never hears its answers again: a request that waits forever, or until a time
limit names the wrong culprit. The selector here changes the list only in the process that made
it; in a child the parent's loop never runs, so its bookkeeping there does not matter.
"""

from __future__ import annotations

import asyncio
import os
import selectors
from typing import Any


def new_event_loop() -> asyncio.AbstractEventLoop:
    """``asyncio.new_event_loop()`` on a :class:`ThisProcessSelector`."""
    return asyncio.SelectorEventLoop(ThisProcessSelector())


class ThisProcessSelector(selectors.DefaultSelector):
    """The default selector, inert for the sockets it watches in any process but its maker."""

    def __init__(self) -> None:
        super().__init__()
        self.pid = os.getpid()

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        if self.pid != os.getpid():
            raise RuntimeError("this event loop runs only in the process that made it, not a forked child")
        return super().register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        if self.pid != os.getpid():
            return self.get_key(fileobj)  # the parent's watch on this socket, left as it is
        return super().unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        if self.pid != os.getpid():
            return self.get_key(fileobj)
        return super().modify(fileobj, events, data)
