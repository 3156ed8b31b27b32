"""The policy's weights sent to the servers' workers in memory: a gloo group of the trainer
(rank 0) and every worker of every server, and the weights broadcast over it in buckets.

Used by both sides: the trainer (:mod:`.server`) and the worker extension inside each server
(:mod:`.worker_extension`), so this module imports only torch. The group is made from torch's own
parts (a ``TCPStore`` the trainer serves, a ``ProcessGroupGloo`` on it), not
``torch.distributed.init_process_group``: it lives beside the trainer's own process group (DDP,
FSDP2) and the server's, and touches neither.

A bucket is a header (JSON: names, shapes, the dtype; as bytes) and then its tensors, each
broadcast as it is (no packing copy). An empty header ends the weights, so the receiver needs no
list of names beforehand and the sender gathers (FSDP2) one weight at a time. The sender gathers
the next bucket while the last one is on the wire; the receiver takes the next bucket on a thread
while its caller loads this one.

A sync stops as soon as any member stops it (a worker's load failed, the trainer was interrupted
or heard a server fail): the member says so in the group's store, which every member's waits look
at every :data:`POLL_S` seconds, so no one waits out the group's timeout on a peer that will send
or take nothing more, and every receiving thread ends. A stopped sync leaves operations half done
in gloo's own threads (they end at the group's timeout): each member lets go of the group on a
thread of its own once they ended (:meth:`WeightsGroup.let_go`), and the trainer makes a new one
for the next sync.

Each worker joins at :func:`advertised_address`: its machine's address towards rank 0, or the one
set in ``LIGHTNING_PPO_SYNC_HOST``; the address is written to the store too, so that a join that
fails says who gave which address.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from lightning_ppo.rollout.engines.server.inherited import note
from lightning_ppo.rollout.engines.server.let_go import drop_later, ended, exiting, joined_at_exit

BUCKET_BYTES = 256 * 2**20  # per broadcast: large enough to stream, small enough to hold twice
POLL_S = 0.1  # how often a wait looks for a stop in the store: a store call each, ~0.1 ms on a LAN
PROBE_S = 5.0  # at most, for a worker's first look at rank 0's store (refused: its join ended)
SAY_STOP_S = 1.0  # at most, for a member's stop to reach the store (a store call: ~0.1 ms on a LAN)
SYNC_HOST_VARIABLE = "LIGHTNING_PPO_SYNC_HOST"  # a server's address for the group, where it is set

Stopped = Callable[[], BaseException | None]  # what stopped the sync, if anything has


class SyncStopped(RuntimeError):
    """Rank ``rank`` of the group stopped the sync (said in the store), for ``why``."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(f"{self.by(rank)}: {why}")
        self.rank, self.why = rank, why

    @staticmethod
    def by(rank: int) -> str:
        """How the error begins (a server's answer that holds it with ``rank`` 0 echoes the trainer)."""
        return f"rank {rank} of the weights group stopped the sync"


class JoinFailed(RuntimeError):
    """Rank 0's join failed; ``addresses``: those the other ranks gave in the store (by rank)."""

    def __init__(self, error: BaseException, addresses: dict[int, str]) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.addresses = addresses


@dataclass
class WeightsGroup:
    """This process's place in the weights group: the gloo ``process_group`` the weights travel on,
    and the group's ``store`` (its rendezvous, under the group's secret) beside it, where a member
    says it stopped a sync and why, and each worker the address it gave."""

    process_group: Any
    store: Any
    rank: int
    # Broadcasts started and maybe not completed (those completed are dropped before each bucket):
    # the group is destroyed only once none is pending (:mod:`.let_go`).
    works: list[Any] = field(default_factory=list)
    # Held while a broadcast is started and noted in ``works``, and while the group is let go: a
    # broadcast a receiving thread started as the loading thread let go would be left out of the
    # works the let-go waits for, and the group destroyed while it was pending.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # The process that made the group: a forked child's copy is the parent's (:mod:`.inherited`).
    pid: int = field(default_factory=os.getpid, repr=False, compare=False)

    def __post_init__(self) -> None:
        for handle in (self.process_group, self.store):
            if handle is not None:
                note(handle)
        _GROUPS[id(self)] = self

    def stop(self, sync: str, why: str) -> None:
        """Every member's waits in sync ``sync`` end with :class:`SyncStopped`; the first reason stands
        (on one line, as the trainer's error says it: a server's tracebacks run over many). Said on
        a thread of its own, waited for :data:`SAY_STOP_S` s at most: a server's store calls go to
        rank 0's store, and one to a trainer that neither answers nor closes (stopped, its machine
        gone) never returns, not even at the store's timeout, which held a SIGTERM'd server's exit."""
        store, said = self.store, f"{self.rank} {' '.join(why.split())[:1000]}"
        if store is None or exiting():  # let go of, or the process ends: its pipes close with it
            return
        saying = threading.Thread(
            target=_say, args=(store, f"stop/{sync}", said), name="lightning-ppo-weights-stop", daemon=True
        )
        joined_at_exit(saying)  # in a store call (GIL released) as the interpreter finalizes: :mod:`.let_go`
        saying.start()
        saying.join(SAY_STOP_S)

    def stopped(self, sync: str) -> SyncStopped | None:
        """What stopped sync ``sync``, if a member did (or this one let go of the group)."""
        store = self.store
        if store is None:
            return SyncStopped(self.rank, "this member let go of the weights group")
        if not store.check([f"stop/{sync}"]):
            return None
        rank, _, why = store.get(f"stop/{sync}").decode().partition(" ")
        return SyncStopped(int(rank), why)

    def let_go(self) -> None:
        """Drop this process's hold of the group on a thread of its own once the operations a
        stopped sync left in gloo's threads have ended (up to the group's timeout): the group's
        destructor waits for them, which must not hold the trainer's or a server worker's own
        thread, nor run as the process exits (:mod:`.let_go`)."""
        with self.lock:  # no broadcast starts after this, and every one started is in ``pending``
            held, pending = [self.process_group, self.store], self.works
            self.process_group = self.store = None
            self.works = []
        drop_later(held, pending, "lightning-ppo-weights-let-go")

    def __del__(self) -> None:
        # A group nobody let go of (an engine dropped with its group, a test's leftover) held by a
        # reference cycle: the garbage collector destroyed it on whatever thread allocated as it
        # ran (a receiving thread starting a broadcast), whose destructor waited there for a
        # stopped sync's pending broadcasts, up to the group's timeout. Let go of as it goes; not
        # in a forked child, where the collector may run before ``_none_in_child`` (in the fork
        # hooks before it): its locks are the parent's copies, its works the parent's threads'.
        if getattr(self, "pid", None) != os.getpid():
            return
        if getattr(self, "process_group", None) is not None or getattr(self, "store", None) is not None:
            with contextlib.suppress(Exception):  # late in the interpreter's end: destroyed in place
                self.let_go()


def _say(store: Any, key: str, value: str) -> None:
    try:
        store.compare_set(key, "", value)
    except Exception:  # noqa: BLE001, S110  (the store gone with rank 0: nobody left to tell)
        pass
    finally:
        ended()


_GROUPS: weakref.WeakValueDictionary[int, WeightsGroup] = weakref.WeakValueDictionary()


def _none_in_child() -> None:
    """A forked child's copies of the parent's groups: gloo's threads behind them are the parent's,
    so a sync on one waited for good, and its store calls went out on the parent's sockets."""
    for group in list(_GROUPS.values()):
        group.process_group = group.store = None
        group.works = []  # the parent's, never completed here (:mod:`.inherited` keeps them)
        group.lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _GROUPS.clear()


os.register_at_fork(after_in_child=_none_in_child)


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A socket listening on ``host`` alone (``port`` 0: a free one), for rank 0's store. Given only a
    port, torch's ``TCPStore`` listens on every interface of the machine (``*:port``), so a group
    meant for 127.0.0.1 would be reachable from the network; given this socket it serves where
    ``host`` says, and no other process can take the port between choosing it and serving on it.
    A name is bound at the address it resolves to first (resolving it again in ``bind`` could give
    another of its addresses)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return socket.create_server(address, family=family)


def address_towards(host: str) -> str:
    """This machine's address on the interface that routes to ``host`` (no packet is sent): the
    address ``host``'s packets to this machine arrive at, not the machine's name, which Debian and
    Ubuntu map to 127.0.1.1."""
    family = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def advertised_address(rank_zero: str) -> tuple[str, str]:
    """The address a server's worker gives the group (every member connects to it), and why that
    one: ``LIGHTNING_PPO_SYNC_HOST`` where it is set (a multi-homed server, a NAT), else this
    machine's address towards rank 0 (``rank_zero``), which reaches the trainer at least."""
    configured = os.environ.get(SYNC_HOST_VARIABLE, "").strip()
    if configured:
        return configured, SYNC_HOST_VARIABLE
    why = f"its address towards rank 0 at {rank_zero}; {SYNC_HOST_VARIABLE} sets another"
    return address_towards(rank_zero), why


def open_group(
    host: str,
    port: int,
    rank: int,
    world: int,
    timeout: float,
    device_host: str | None,
    secret: str = "",
    listener: socket.socket | None = None,
    failed: Stopped = lambda: None,
) -> WeightsGroup:
    """This process's place in the weights group: rank 0 (the trainer) serves the store on ``host:port``
    and the others connect to it; returns once all ``world`` have joined, or raises after ``timeout``
    seconds (rank 0: :class:`JoinFailed`). ``device_host``: the address the others reach this
    process at (None: gloo's default, the machine's name, which some systems map to 127.0.1.1).
    ``secret``: the rendezvous keys' prefix, handed to the servers over their keyed route, so that
    a stranger who reaches the store's port cannot take a rank's place without guessing it.
    ``listener`` (rank 0): the :func:`listening_socket` it serves on (closed here); without one it
    binds ``host:port`` itself. Rank 0 starts its part only once every other rank is ready (its
    address given, its device made), and raises what ``failed()`` returns meanwhile (a server's
    answer to its join call: a worker that cannot join fails the join at once)."""
    wait = timedelta(seconds=timeout)
    if rank == 0:
        store = _serve_store(listener or listening_socket(host, port), world, wait)
    else:
        store = note(TCPStore(host, port, world, is_master=False, timeout=wait, wait_for_workers=False))
    store = note(PrefixStore(f"lightning-ppo-weights/{secret}", store))
    if rank > 0:
        store.set(f"address/{rank}", device_host or socket.gethostname())
    options = ProcessGroupGloo._Options()
    options._timeout = wait
    device = ProcessGroupGloo.create_device(hostname=device_host) if device_host else None
    options._devices = [device or ProcessGroupGloo.create_default_device()]
    try:
        if rank > 0:
            store.set(f"ready/{rank}", "1")
        else:
            _await_the_others(store, world, timeout, failed)
        return WeightsGroup(ProcessGroupGloo(store, rank, world, options), store, rank)
    except BaseException as err:
        if rank > 0:
            raise
        said = err
        if isinstance(err, Exception) and not isinstance(err, JoinFailed) and err is not failed():
            said = JoinFailed(err, _addresses(store, world))
        # Rank 0's store goes now (Ctrl-C too), not with the last reference to these frames (the
        # error's traceback, which a notebook keeps): the ranks waiting in it stop at once
        store = None
        traceback.clear_frames(err.__traceback__)
        if said is err:
            raise
        raise said from None


def still_served(host: str, port: int, timeout: float) -> None:
    """For a rank told rank 0's port by rank 0 (a server's worker), which listens before it tells
    it: a connection refused there means its join ended (Ctrl-C, a failure), said at once, where
    ``TCPStore`` would retry it for twice the group's timeout. Anything else (no answer yet, no
    route) is left to the store's own connect."""
    try:
        socket.create_connection((host, port), timeout=min(timeout, PROBE_S)).close()
    except ConnectionRefusedError:
        raise RuntimeError(
            f"nothing serves rank 0's store at {host}:{port} any more: the trainer stopped this join"
        ) from None
    except OSError:
        pass


def _await_the_others(store: Any, world: int, timeout: float, failed: Stopped) -> None:
    """Until every rank but 0 is ready, looked at every :data:`POLL_S` s: raises what ``failed()``
    returns, and :class:`JoinFailed` after ``timeout`` seconds."""
    ready = [f"ready/{rank}" for rank in range(1, world)]
    deadline = time.monotonic() + timeout
    while not store.check(ready):
        if (error := failed()) is not None:
            raise error
        if time.monotonic() > deadline:
            missing = [rank for rank in range(1, world) if not store.check([f"ready/{rank}"])]
            error = TimeoutError(f"rank(s) {missing} did not join within {timeout:g} s")
            raise JoinFailed(error, _addresses(store, world))
        time.sleep(POLL_S)


def _addresses(store: Any, world: int) -> dict[int, str]:
    """The addresses the other ranks gave (those that got as far as the store)."""
    keys = {rank: f"address/{rank}" for rank in range(1, world)}
    with contextlib.suppress(Exception):  # the store itself failing: no addresses to tell
        return {rank: store.get(key).decode() for rank, key in keys.items() if store.check([key])}
    return {}


def _serve_store(listener: socket.socket, world: int, wait: timedelta) -> TCPStore:
    """Rank 0's store, served on ``listener``'s address only. The store gets a duplicate of its
    descriptor (it closes what it serves on), and ours is closed here whatever happens."""
    with listener:
        host, port = listener.getsockname()[:2]
        return note(
            TCPStore(
                host,
                port,
                world,
                is_master=True,
                timeout=wait,
                wait_for_workers=False,
                master_listen_fd=os.dup(listener.fileno()),
            )
        )


def send(
    group: WeightsGroup,
    weights: Iterable[tuple[str, Tensor]],
    sync: str = "",
    failed: Stopped = lambda: None,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Broadcast ``weights`` (contiguous CPU tensors, one dtype) from rank 0 as sync ``sync``,
    bucket by bucket, then the end. A bucket's tensors go as they are (no packing copy), while the
    next bucket is gathered (two buckets in flight at most). Stopped as soon as ``failed()`` returns
    an error (a server's answer to its receive call) or a member stopped the sync; whatever ends it
    early (that, an error of ``weights``, Ctrl-C) is said in the store, so every member stops too.
    A send on a daemon thread (a user's fit there) stops as the process exits, which joins it: it
    took the GIL back from gloo's wait as the interpreter finalized (SIGABRT; :mod:`.let_go`)."""
    try:  # registered inside: a Ctrl-C just after would leave it registered, the exit joining itself
        joined_at_exit(threading.current_thread())
        _send(group, weights, lambda: _exiting(group.rank) or failed() or group.stopped(sync), bucket_bytes)
    except BaseException as err:
        with contextlib.suppress(Exception):  # the store gone with the group: nobody left to tell
            group.stop(sync, f"{type(err).__name__}: {err}")
        _kept_at_exit(group)
        raise
    finally:
        ended()


def _kept_at_exit(group: WeightsGroup) -> None:
    """A sync the exit stopped leaves broadcasts pending: the group, a module's global or held by a
    daemon thread's frame, must not be destroyed as the interpreter finalizes (its destructor waited
    for them, up to its timeout): let go of now, it is kept for good (:mod:`.let_go`)."""
    if exiting():
        group.let_go()


def _exiting(rank: int) -> SyncStopped | None:
    return SyncStopped(rank, "this process is exiting") if exiting() else None


def _send(
    group: WeightsGroup, weights: Iterable[tuple[str, Tensor]], stopped: Stopped, bucket_bytes: int
) -> None:
    in_flight: list[tuple[Any, Tensor]] = []  # the last bucket's broadcasts, and their tensors
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in weights:
        if bucket and size + tensor.numel() * tensor.element_size() > bucket_bytes:
            in_flight = _send_bucket(group, bucket, in_flight, stopped)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    if bucket:
        in_flight = _send_bucket(group, bucket, in_flight, stopped)
    for work, _ in in_flight:
        _wait(work, stopped)
    _broadcast(group, torch.zeros(1, dtype=torch.int64), stopped)


def receive(group: WeightsGroup, sync: str = "") -> Receiver:
    """The weights rank 0 sends as sync ``sync`` (:class:`Receiver`)."""
    return Receiver(group, sync)


class Receiver:
    """The weights rank 0 sends, one ``(name, tensor)`` at a time as they arrive (iterate once); the
    next bucket is received on a thread of its own while the caller loads this one. A caller whose
    load fails calls :meth:`stop`: every member hears of it, and the thread ends; a sync another
    member stopped raises :class:`SyncStopped` from the iteration."""

    def __init__(self, group: WeightsGroup, sync: str) -> None:
        self.group, self.sync = group, sync
        self.buckets: queue.Queue[list[tuple[str, Tensor]] | BaseException | None] = queue.Queue(maxsize=1)
        self.ended = threading.Event()  # the caller stopped: the thread hands it nothing more
        self.whole = False  # the end of the weights was reached
        self.thread = threading.Thread(target=self._pull, name="lightning-ppo-weights", daemon=True)
        joined_at_exit(self.thread)  # it must not be in gloo as the interpreter finalizes (:mod:`.let_go`)
        self.thread.start()

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        while (item := self.buckets.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield from item
        self.whole = True

    def stop(self, why: str) -> None:
        """The caller's load failed for ``why``: every member stops this sync, and the bucket held
        for the caller is dropped (the thread drops its own as it ends, within :data:`POLL_S`)."""
        self.ended.set()
        with contextlib.suppress(Exception):  # the store gone (rank 0 ended): nobody left to tell
            self.group.stop(self.sync, why)
        with contextlib.suppress(queue.Empty):
            self.buckets.get_nowait()

    def _pull(self) -> None:
        try:
            while (bucket := _receive_bucket(self.group, self._stopped)) is not None:
                self._put(bucket)
            self._put(None)
        except BaseException as err:  # noqa: BLE001  (raised by the loading thread, in __iter__)
            _kept_at_exit(self.group)
            self._put(err)
        finally:
            ended()

    def _stopped(self) -> SyncStopped | None:
        return _exiting(self.group.rank) or self.group.stopped(self.sync)

    def _put(self, item: list[tuple[str, Tensor]] | BaseException | None) -> None:
        while not self.ended.is_set() and not exiting():
            with contextlib.suppress(queue.Full):
                self.buckets.put(item, timeout=POLL_S)
                return


def _receive_bucket(group: WeightsGroup, stopped: Stopped) -> list[tuple[str, Tensor]] | None:
    length = _broadcast(group, torch.zeros(1, dtype=torch.int64), stopped)
    if int(length) == 0:
        return None
    encoded = _broadcast(group, torch.empty(int(length), dtype=torch.uint8), stopped)
    header = json.loads(bytes(encoded.tolist()))
    dtype = getattr(torch, header["dtype"])
    tensors = [
        (name, torch.empty(shape, dtype=dtype))
        for name, shape in zip(header["names"], header["shapes"], strict=True)
    ]
    works = [_start_broadcast(group, tensor) for _, tensor in tensors]
    for work in works:
        _wait(work, stopped)
    return tensors


def _send_bucket(
    group: WeightsGroup,
    bucket: list[tuple[str, Tensor]],
    in_flight: list[tuple[Any, Tensor]],
    stopped: Stopped,
) -> list[tuple[Any, Tensor]]:
    """Broadcast one bucket's header, then its tensors without waiting for them, once the bucket
    before is sent; the broadcasts, with their tensors kept alive until they end."""
    header = {
        "names": [name for name, _ in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "dtype": str(bucket[0][1].dtype).removeprefix("torch."),
    }
    encoded = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8)
    for work, _ in in_flight:
        _wait(work, stopped)
    if (error := stopped()) is not None:  # before each bucket, however fast the last one went
        raise error
    _broadcast(group, torch.tensor([encoded.numel()], dtype=torch.int64), stopped)
    _broadcast(group, encoded, stopped)
    return [(_start_broadcast(group, tensor), tensor) for _, tensor in bucket]


def _broadcast(group: WeightsGroup, tensor: Tensor, stopped: Stopped) -> Tensor:
    """A header's broadcast (twice a bucket, and the end): the works completed are forgotten here,
    not at every tensor's (a bucket holds hundreds)."""
    with group.lock:
        group.works[:] = [work for work in group.works if not work.is_completed()]
    _wait(_start_broadcast(group, tensor), stopped)
    return tensor


def _start_broadcast(group: WeightsGroup, tensor: Tensor) -> Any:
    """The broadcast of ``tensor`` from rank 0, started, and noted in ``group.works``; its work holds
    gloo's context (its pairs), which a forked child must never destroy either (:mod:`.inherited`):
    a failed sync's traceback keeps the work after the group is let go."""
    with group.lock:  # against a let-go on another thread (``WeightsGroup.lock``); enqueuing is quick
        work = note(_process_group(group).broadcast([tensor], _from_rank_zero()))
        group.works.append(work)
    return work


def _process_group(group: WeightsGroup) -> Any:
    if group.process_group is None:
        raise SyncStopped(group.rank, "this member let go of the weights group")
    return group.process_group


def _wait(work: Any, stopped: Stopped) -> None:
    """Until ``work`` is done: its own error (a peer gone, the group's timeout) is raised, and so is
    what stopped the sync, looked for every :data:`POLL_S` seconds of waiting and once more when
    ``work`` failed: a member says why it stops before it lets go of the group (which closes its
    pairs), so a closed pipe met first (this thread ran late) still gives the member's reason."""
    while True:
        try:
            work.wait(timedelta(seconds=POLL_S))
            return
        except RuntimeError:
            if work.is_completed():  # failed (or done just as the wait gave up): wait() says which
                _finished(work, stopped)
                return
        if (error := stopped()) is not None:
            raise error


def _finished(work: Any, stopped: Stopped) -> None:
    """A completed ``work``'s own error, unless a member stopped the sync: then what it said."""
    try:
        work.wait()
    except RuntimeError as err:
        try:
            error = stopped()
        except Exception:  # noqa: BLE001  (the store gone too, with rank 0: the work's error says so)
            error = None
        if error is not None:
            raise error from err
        raise


def _from_rank_zero() -> Any:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    return options
