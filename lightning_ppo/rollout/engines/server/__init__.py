"""Generation on running vLLM servers (``generation.engine: vllm_server``), one part per file.

The trainer's side:

- :mod:`.engine`: :class:`VLLMServerEngine`, what the module calls: sync the weights, sample a batch.
- :mod:`.client`: one server over HTTP (JSON, every call bounded in time, the API key).
- :mod:`.deadline`: one deadline for a whole call of the client's, however its bytes trickle in.
- :mod:`.connections`, :mod:`.session`, :mod:`.batch`: a batch's completions on the engine's own
  event loop, one pooled session per server, one bound for the whole batch.
- :mod:`.routing`: each request to the server expected to answer it first, a limit per server.
- :mod:`.concurrent_calls`: a few calls to every server at once, on threads.
- :mod:`.suppress`: how a request keeps ``generation.suppress_tokens`` from being sampled.
- :mod:`.answers`: what a completion answer must hold (ids of the vocabulary, finite log-probs).
- :mod:`.weight_sync`: weights written to a file, and the checksums that prove a sync arrived.
- :mod:`.checksum`: one tensor's checksum, a bounded chunk at a time (it runs on the server too).
- :mod:`.memory_sync`, :mod:`.weight_group`: weights sent in memory over a gloo group.
- :mod:`.inherited`: the group's handles, never destroyed by a forked child (gloo's threads are the parent's).
- :mod:`.let_go`: the group dropped on a thread once its broadcasts ended, never as the process exits.

The server's side (``lightning-ppo serve``):

- :mod:`.worker_extension`: the methods vLLM's workers run to load weights and report checksums.
- :mod:`.key_guard`: the API key on every route, not only vLLM's ``/v1`` ones.
- :mod:`.local_server`: a server on this machine as a child process (notebooks, tests, benchmarks).

Nothing heavy is imported here: vLLM's workers import :mod:`.worker_extension` through this package.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "VLLMServerEngine":
        from lightning_ppo.rollout.engines.server.engine import VLLMServerEngine

        return VLLMServerEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
