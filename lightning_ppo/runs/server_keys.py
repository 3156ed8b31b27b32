"""Where a generation server's API key is kept for the trainer to find: a file only its user can
read, named by the server's address.

``lightning-ppo serve`` started without ``VLLM_API_KEY`` (and without ``--no-api-key``) makes a
random key, starts the server with it and writes it to ``<folder>/<host>_<port>.key`` (the folder
0700, the file 0600, both the user's); the trainer, without ``VLLM_API_KEY`` of its own, reads
the file its ``server_urls`` entry names. The folder is ``$XDG_CACHE_HOME/lightning_ppo/server_keys``
(``~/.cache/...``): on a cluster whose home folder every node mounts, a trainer on another node
finds a server's key too; ``$XDG_RUNTIME_DIR`` is removed when the user's last session on the node
ends, which a server left running outlives. The key never appears on a command line, in a config
or in a log. Light: ``lightning-ppo serve`` imports it before it becomes the server.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import socket
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from lightning_ppo.runs.errors import UsageError

API_KEY_VARIABLE = "VLLM_API_KEY"  # vLLM's own: the server and the trainer read the same variable
LOOPBACK = ("127.0.0.1", "localhost", "::1")
EVERY_ADDRESS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class ServerKey:
    """The key a call to a server carries (``None``: none) and where it came from: the
    environment variable, a key file's path, or ``None``; ``expected`` is the key file looked for."""

    value: str | None
    source: str | None
    expected: Path | None  # None: VLLM_API_KEY set where no key folder can be named (no home)


def key_folder() -> Path:
    """``$XDG_CACHE_HOME/lightning_ppo/server_keys``, ``~/.cache/...`` where that is unset."""
    cache = os.environ.get("XDG_CACHE_HOME")
    if not cache:
        try:
            cache = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):  # a container's uid with no passwd entry and no HOME
            raise UsageError(
                f"no home folder to keep server keys in: set XDG_CACHE_HOME, or {API_KEY_VARIABLE} "
                "to the server's key"
            ) from None
    return Path(cache) / "lightning_ppo" / "server_keys"


def key_names(host: str, port: int) -> list[str]:
    """The names a server listening on ``host`` is reached by (a file each): this machine's
    loopback (kept apart per machine: a home folder may be shared by several nodes), and for every
    address, also the node's name (the URL ``lightning-ppo serve`` prints)."""
    node = socket.gethostname()
    if host in LOOPBACK:
        return [_name(f"loopback@{node}", port)]
    if host in EVERY_ADDRESS:
        return [_name(node, port), _name(f"loopback@{node}", port)]
    return [_name(host, port)]


def key_file(url: str) -> Path:
    """The file holding the key of the server at ``url``."""
    parts = urlparse(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return key_folder() / _name(f"loopback@{socket.gethostname()}" if host in LOOPBACK else host, port)


def server_key(url: str) -> ServerKey:
    """The key for the server at ``url``: ``VLLM_API_KEY`` where set (no key file is looked for:
    a container without a home folder still runs with it), else its key file's."""
    value = environment_key()
    if value is not None:
        return ServerKey(value, API_KEY_VARIABLE, None)
    expected = key_file(url)
    value = _read(expected)
    return ServerKey(value, str(expected) if value else None, expected)


def environment_key() -> str | None:
    """``VLLM_API_KEY`` without the line end a file-made secret carries; refused (without echoing
    it: it would reach logs) where it holds other control characters or spaces."""
    key = (os.environ.get(API_KEY_VARIABLE) or "").strip()
    if any(ord(c) < 33 or ord(c) == 127 for c in key):
        raise UsageError(f"{API_KEY_VARIABLE} holds spaces or control characters: set it to the key alone")
    return key or None


def new_key(host: str, port: int) -> tuple[str, list[Path]]:
    """A random key for a server on ``host``:``port``, written to its key files (each replaced
    whole: a reader never sees half a key); the key and the files."""
    key = secrets.token_urlsafe(32)
    folder = _private_folder()
    paths = [folder / name for name in key_names(host, port)]
    for path in paths:
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        descriptor = os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(key + "\n")
        os.replace(temporary, path)
    return key, paths


def claim_address(host: str, port: int) -> None:
    """Refuse a second ``lightning-ppo serve`` at ``host``:``port`` while the first runs or starts:
    an exclusive lock on ``<folder>/<name>.lock``, held by a descriptor the server inherits (kept
    open through ``exec``), so the kernel drops it only when the server exits. A port found free
    is no proof: vLLM binds it only once imported, seconds later, and a second ``serve`` meanwhile
    would write its key over the first's. Nothing to keep apart where no key file is written or
    removed (``VLLM_API_KEY`` set and no key folder can be named)."""
    try:
        folder = _private_folder()
    except UsageError:
        if environment_key() is not None:
            return
        raise
    path = folder / lock_name(host, port)
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise UsageError(f"the server lock file {path} cannot be opened: {err.strerror}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        taken = f"{host}:{port} is in use (a server already runs there?)"  # as serve's check of the port
        raise UsageError(f"lightning-ppo serve --port {port}: {taken}") from None
    os.set_inheritable(descriptor, True)


def lock_name(host: str, port: int) -> str:
    """The name of the lock :func:`claim_address` takes for ``host``:``port`` in the key folder,
    beside the key file; held open by the server that runs there (what tells a ``LocalServer``
    whether its own ``serve`` wrote the key file)."""
    return key_names(host, port)[0].removesuffix(".key") + ".lock"


def forget_keys(host: str, port: int) -> None:
    """Removes the key files of a server on ``host``:``port`` (a server started there with a key of
    the user's, or none, leaves no earlier server's key for the trainer to send). Where no key
    folder can be named (no home folder), no key file can be there either."""
    try:
        folder = key_folder()
    except UsageError:
        return
    for name in key_names(host, port):
        (folder / name).unlink(missing_ok=True)


def _private_folder() -> Path:
    """The key folder, made 0700; refused where another user owns it."""
    folder = key_folder()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid():
        raise UsageError(f"{folder} belongs to another user: lightning-ppo serve keeps server keys there")
    if stat.S_IMODE(info.st_mode) & 0o077:
        folder.chmod(0o700)
    return folder


def _read(path: Path) -> str | None:
    """The key in ``path``, or ``None`` where there is none; refused where other users may read it
    or another user owns it (a key anyone could read, or plant, guards nothing)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise UsageError(f"the server key file {path} cannot be read: {err.strerror}") from None
    with os.fdopen(descriptor) as file:
        info = os.fstat(file.fileno())
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise UsageError(
                f"the server key file {path} is readable by other users or not yours: remove it and "
                "start the server again with `lightning-ppo serve`"
            )
        key = file.read().strip()
    return key or None


def _name(host: str, port: int) -> str:
    return re.sub(r"[^A-Za-z0-9.@-]", "_", host) + f"_{port}.key"
