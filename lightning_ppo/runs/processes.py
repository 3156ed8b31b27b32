"""Whether the process that wrote a file (a lock, a temporary checkpoint) has ended.

A checkpoint folder can sit on a filesystem that several machines share (NFS, a cluster's scratch
disk). A process id names a process only on the host that issued it: the same number on another
host is another process, or none. So a writer is recorded as host and pid, and judged gone only
when its host is this one and no process has its pid.
"""

from __future__ import annotations

import os
import re
import socket


def host_name() -> str:
    """This machine's name as it goes into file names: characters other than letters, digits, ``.``
    and ``-`` (none in a valid host name) become ``_``."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())


def writer_gone(host: str, pid: int) -> bool:
    """Whether process ``pid`` of ``host`` has ended; ``False`` whenever that cannot be known here
    (another host, Windows, another user's live process)."""
    if host != host_name():
        return False
    if pid == os.getpid():  # this process wrote nothing yet: an earlier one's pid (a restarted container)
        return True
    if os.name != "posix":
        return False  # os.kill(pid, 0) would terminate the process on Windows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False
