"""``python -m tests.call MODULE FUNCTION RANK ARGS``: ``FUNCTION(RANK, *ARGS)`` of ``MODULE`` (``ARGS``
a JSON list), as ``torch.multiprocessing.spawn`` calls its function in each process it starts; see
``tests.helpers.spawn_forked``."""

from __future__ import annotations

import importlib
import json
import sys

if __name__ == "__main__":
    module, name, rank, args = sys.argv[1:]
    getattr(importlib.import_module(module), name)(int(rank), *json.loads(args))
