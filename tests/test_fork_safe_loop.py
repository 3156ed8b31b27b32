"""The process's background event loop after a fork (``lightning_ppo/runs/fork_safe_loop.py``): a
forked child that closes one of the loop's connections leaves the parent's connection working.
Parent and child share one epoll object; closing a transport in the child used to remove the
parent's socket from it, and the parent's next read on that connection never woke up."""

from __future__ import annotations

import asyncio
import os
import signal
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


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_child_forked_while_the_loop_was_being_made_gets_its_own_loop():
    """A fork from one thread while another holds the loop's lock (making the loop): the child's
    first async call makes its own loop instead of waiting for a lock no thread there will free."""
    from lightning_ppo.runs import background_loop as module

    with module._LOCK:  # as the thread starting the loop holds it
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # bounded: a child that waits forever dies of SIGALRM
            try:
                loop = module.background_loop()
                done = asyncio.run_coroutine_threadsafe(asyncio.sleep(0, result=7), loop).result(20)
                os._exit(0 if done == 7 else 3)
            finally:
                os._exit(4)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
