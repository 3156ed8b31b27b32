"""Rank 0's rendezvous store for the NCCL group (``generation.sync_transport: nccl``), served while
the servers' answers to their init calls are watched.

vLLM's ``StatelessProcessGroup.create`` makes rank 0's ``TCPStore`` wait, inside its constructor,
until every rank of the world has connected, for up to the store's timeout
(``generation.server_timeout``). A server that failed its init at once (an error answered, its
process gone) never sends its workers, so the trainer sat out the whole timeout before saying why.
Here the constructor runs on a thread of its own while rank 0 looks at the servers' answers every
:data:`POLL_S` seconds: a failure is raised at once (so is Ctrl-C), and the store is let go, so the
workers of the other servers, waiting in it for NCCL's id, stop waiting too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as Pending
from datetime import timedelta

from torch.distributed import TCPStore

POLL_S = 0.1  # how often rank 0 looks at the servers' answers while the workers connect
RELEASE_S = 5.0  # at most, for the constructor given up on to return once it is released

Failed = Callable[[], BaseException | None]  # a server's failed answer, if one came


def serve_rendezvous(listener: socket.socket, world: int, timeout: float, failed: Failed) -> TCPStore:
    """The store on ``listener``'s address (a duplicate of its descriptor; the caller closes its
    own), once all ``world`` ranks have connected (vLLM's workers count themselves in as they
    connect); what ``failed()`` returns meanwhile is raised at once, and the store's own error after
    ``timeout`` seconds."""
    host, port = listener.getsockname()[:2]
    served: Future[TCPStore] = Future()
    given_up, released = threading.Event(), threading.Event()
    thread = threading.Thread(
        target=_serve,
        args=(host, port, os.dup(listener.fileno()), world, timeout, served, given_up, released),
        name="lppo-nccl-rendezvous",
        daemon=True,
    )
    thread.start()
    try:
        while True:
            with contextlib.suppress(Pending):
                return served.result(timeout=POLL_S)
            if (error := failed()) is not None:
                raise error
    except BaseException:
        given_up.set()
        if not served.done():  # a store that failed by itself waits for nobody
            _release(host, port, world)
        released.set()
        thread.join(RELEASE_S)
        del served  # a store made meanwhile: dropped, not kept alive by the traceback's frame
        raise


def _serve(
    host: str,
    port: int,
    fd: int,
    world: int,
    timeout: float,
    served: Future,
    given_up: threading.Event,
    released: threading.Event,
) -> None:
    """The constructor's wait, as vLLM's ``create`` makes it (``use_libuv=False``, as vLLM's does).
    A store made after rank 0 gave up is dropped here once the releasing connections are made (a
    connection to a store going away would wait out its own timeout): its clients' waits end."""
    try:  # the store takes ``fd`` over, and closes it where it fails
        store = TCPStore(
            host,
            port,
            world,
            is_master=True,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=fd,
            use_libuv=False,
        )
    except BaseException as err:  # noqa: BLE001  (raised by the waiting thread, or nobody waits)
        served.set_exception(err)
        return
    if given_up.is_set():
        released.wait(RELEASE_S)
    else:
        served.set_result(store)


def _release(host: str, port: int, world: int) -> None:
    """Ends the constructor's wait now rather than at its timeout: connections that count as the
    missing ranks (each adds one to the count it waits on, which counts rank 0 already: ``world - 1``
    cover any number missing). The store stays up until they are made (:func:`_serve`); one that
    failed by its own timeout meanwhile takes none: nothing to release."""
    with contextlib.suppress(Exception):
        for _ in range(world - 1):
            TCPStore(
                host, port, world, is_master=False, timeout=timedelta(seconds=RELEASE_S), use_libuv=False
            )
