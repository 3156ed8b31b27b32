"""The process's background event loop after a fork (``lightning_ppo/runs/fork_safe_loop.py``): a
forked child that closes one of the loop's connections leaves the parent's connection working.
Parent and child share one epoll object; closing a transport in the child used to remove the
parent's socket from it, and the parent's next read on that connection never woke up."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

from lightning_ppo.runs.background_loop import background_loop


@pytest.mark.skipif(sys.platform != "linux", reason="the epoll object a fork shares is Linux's")
def test_a_forked_child_closing_a_connection_leaves_the_parents_working():
    with socket.create_server(("127.0.0.1", 0)) as server:
        loop = background_loop()
        port = server.getsockname()[1]
        opened = asyncio.run_coroutine_threadsafe(asyncio.open_connection("127.0.0.1", port), loop)
        reader, writer = opened.result(30)
        peer, _ = server.accept()
        with peer:
            pid = os.fork()
            if pid == 0:  # the child lets go of the connection it inherited, as a user's client might
                try:
                    writer.transport.close()
                finally:
                    os._exit(0)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
            peer.sendall(b"still here\n")
            line = asyncio.run_coroutine_threadsafe(reader.readline(), loop)
            assert line.result(20) == b"still here\n"  # hung, then TimeoutError, before the fix
        writer.close()
