"""Generation on running vLLM servers (``generation.engine: vllm_server``).

Each rank sends its prompts, as token ids, to the servers' OpenAI-compatible completions route,
one request per prompt with the seed drawn from torch's generator (so a run samples as the
colocated ``vllm`` engine does, and resumes exactly), each to the server expected to answer it
first (by the latencies of earlier batches), up to the rank's share of
``generation.server_max_in_flight`` on each (:mod:`.routing`).
The sampled tokens and the engine's processed log-probs come back as the same
:class:`~lightning_ppo.ppo.rollout_data.Rollout`.

Before every rollout rank 0 syncs the policy's weights into every server (:mod:`.weight_sync`);
the first sync, and every one under ``generation.verify_sync``, is checked against the trainer's
weights. Before the first, each server is checked to serve the policy's architecture, vocabulary
and tokenizer, with the sampling settings this package needs. Every call is bounded by
``generation.server_timeout`` (:mod:`.client`), and a batch's requests together by the same
bound without an answer (:mod:`.batch`); they go over pooled connections on the engine's own
event loop (:mod:`.connections`), closed at the end of each fit. Before each batch a synced
server is asked which weights it holds, and after it each server that answered: one restarted since
the last sync (serving its startup checkpoint) stops the run in one line. Servers are started with
``lightning-ppo serve``.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor, nn

from lightning_ppo.config import GenerationConfig
from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout.engines import Placement
from lightning_ppo.rollout.engines.completions import completions_to_rollout, group_seeds, prompt_groups
from lightning_ppo.rollout.engines.server.answers import BadAnswer, samples_of
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient
from lightning_ppo.rollout.engines.server.concurrent_calls import Stalled
from lightning_ppo.rollout.engines.server.connections import Connections
from lightning_ppo.rollout.engines.server.memory_sync import MemorySync, sync_address
from lightning_ppo.rollout.engines.server.nccl_sync import NcclSync, nccl_refusal
from lightning_ppo.rollout.engines.server.routing import Latencies, Router, rank_shares
from lightning_ppo.rollout.engines.server.session import ServerSession
from lightning_ppo.rollout.engines.server.suppress import Suppression, suppression
from lightning_ppo.rollout.engines.server.weight_sync import (
    combine_workers,
    mismatch,
    sweep_leftovers,
    unchecked,
    write_weights,
)
from lightning_ppo.rollout.engines.server.worker_extension import PROTOCOL
from lightning_ppo.rollout.engines.weights import hf_weights
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.warn import warn

# What `lightning-ppo serve` passes vLLM as --worker-extension-cls (lightning_ppo.serve.EXTENSION).
EXTENSION = f"{__package__}.worker_extension.WeightSyncExtension"

# Letters, digits, punctuation, spaces and a few words: where two tokenizers usually part ways.
_TOKENIZER_PROBE = "The quick brown fox, 0123456789 = 42; x+y*z? (a|b) [done] naïve\n\tend."


class VLLMServerEngine:
    """Samples on the vLLM servers at ``config.server_urls`` under ``hf_generation``'s settings."""

    def __init__(
        self,
        config: GenerationConfig,
        hf_generation: transformers.GenerationConfig,
        placement: Placement,
        tokenizer: Any,
        vocab_size: int,
        from_rank_zero: Callable[[Any], Any] = lambda value: value,
    ) -> None:
        self.servers = [ServerClient(url, config.server_timeout) for url in config.server_urls]
        self.config = config
        self.hf_generation = hf_generation
        self.placement = placement
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.from_rank_zero = from_rank_zero
        self.sync_dir = Path(config.sync_dir or tempfile.gettempdir())
        self.served_names: list[str] = []
        self.described: list[dict[str, Any]] = []
        self.syncs = 0
        # The weights' version a server holds: rank 0's run tag (shared by its ranks at each sync) and
        # the sync's count, so another run's sync of the same count is not taken for this one's.
        self.tag = uuid.uuid4().hex[:12]
        self.requests_sent = [0] * len(self.servers)
        self.last_sync_seconds = 0.0
        self.sync_notes: set[str] = set()  # what a verified sync could not check (weight_sync.unchecked)
        self._memory: MemorySync | NcclSync | None = None
        refusal = nccl_refusal() if config.sync_transport == "nccl" else None
        if refusal is not None:
            raise UsageError(refusal)
        # This rank's requests in flight on each server: its share of generation.server_max_in_flight.
        self.shares = rank_shares(
            config.server_max_in_flight, placement.world_size, placement.rank, len(self.servers)
        )
        self.latencies = Latencies(len(self.servers))  # each server's, measured by the batches (routing)
        self.batch_requests = 1
        self.exact_requests = 0  # samples requested again under allowed_token_ids (_exact_again)
        self.bias_refused: set[int] = set()  # servers that refuse logit_bias (_post)
        # A batch's requests' shared fields, as JSON, by served name and exactness (_encoded).
        self.shared_json: dict[tuple[str, bool], str] = {}
        self._connections: Connections | None = None  # made at the first batch (_connected)
        # Set by close() (a fit ended), cleared by a sync (the next fit): a job on another thread
        # does not open connections meanwhile (_connected). The lock: close() runs on the fit's thread.
        self._closed = False
        self._connections_lock = threading.Lock()

    # --- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def sync_weights(self, policy: nn.Module) -> None:
        """Load ``policy``'s weights into every server (rank 0 writes and asks; every rank joins the
        gathers of a sharded policy), then agree over the ranks on whether it worked."""
        start = time.perf_counter()
        with self._connections_lock:
            self._closed = False  # the fit's thread, syncing before a batch: a fit runs again
        weights = hf_weights(policy)
        error = None
        if self.placement.rank == 0:
            try:
                self._sync(weights, policy)
            except Exception as err:  # any failure is every rank's: the verdict below is broadcast
                error = str(err) if isinstance(err, GenerationServerError) else _sync_failure(err)
            for _ in weights:  # a write that failed part way: the other ranks still wait in gathers
                pass
        else:
            for _ in weights:  # FSDP2: every rank joins each gather
                pass
        error, self.tag = self.from_rank_zero((error, self.tag))
        if error is not None:
            raise GenerationServerError(error)
        self.syncs += 1
        self.last_sync_seconds = time.perf_counter() - start

    def _sync(self, weights: Any, policy: nn.Module) -> None:
        if not self.described:
            self.described = [self._check_server(server, policy) for server in self.servers]
            if self.memory is None:
                sweep_leftovers(self.sync_dir)  # a killed run's weight files
        dtype = getattr(torch, self.described[0]["dtype"])
        verify = self.config.verify_sync or self.syncs == 0
        version = self._version(self.syncs + 1)
        if self.memory is not None:
            sums, held = self.memory.load(weights, dtype, verify, version)
        else:
            sums, held = self._load_file(weights, dtype, verify, version)
        for server, described, answers in zip(self.servers, self.described, held, strict=True):
            if verify:
                self._verify(server, sums, answers, described["packed_modules"])
            server.post("/reset_prefix_cache")  # cached KV blocks came from the old weights
            server.post("/update_weight_version", {"new_version": version})

    def _load_file(
        self, weights: Any, dtype: torch.dtype, verify: bool, version: str
    ) -> tuple[dict[str, Any], list[list[Any]]]:
        """``generation.sync_transport: file``: one safetensors file every server loads."""
        written = write_weights(weights, self.sync_dir, dtype, with_checksums=verify)
        try:
            flag = "1" if verify else "0"
            return written.checksums, [
                server.rpc_all("lppo_load", str(written.path), flag, version) for server in self.servers
            ]
        finally:
            written.path.unlink(missing_ok=True)

    def _verify(self, server: ServerClient, written: dict, held: list[Any], packed: dict) -> None:
        if not all(isinstance(answer, dict) for answer in held):
            raise server.error("weight sync", f"answered {str(held)[:200]!r}, not checksums")
        sums = combine_workers(held)
        problem = mismatch(written, sums, packed)
        note = unchecked(written, sums, packed) if problem is None else None
        if note is not None and note not in self.sync_notes:  # once a run, not at every verified sync
            self.sync_notes.add(note)
            warn(f"{server.url}: {note}")
        if problem is not None:
            raise server.error(
                "weight sync",
                f"after sync {self.syncs + 1} the server's weights are not the trainer's: {problem}",
            )

    # --- checks before the first rollout -------------------------------------------------------

    def _check_server(self, server: ServerClient, policy: nn.Module) -> dict[str, Any]:
        """What the server serves, refused (naming both sides) where it is not ``policy``."""
        try:
            workers = server.rpc_all("lppo_describe")
        except GenerationServerError as err:
            raise server.error(
                "/collective_rpc lppo_describe",
                f"{err.what}. Start the server with `lightning-ppo serve`, which adds the worker extension "
                f"(--worker-extension-cls {EXTENSION}) and VLLM_SERVER_DEV_MODE=1",
            ) from None
        described = {**workers[0], "workers": len(workers)}
        if described.get("protocol", 1) != PROTOCOL:  # 1: the servers before the number was given
            raise server.error(
                "worker extension",
                f"speaks protocol {described.get('protocol', 1)} of lightning_ppo's calls, this trainer "
                f"speaks {PROTOCOL}: start the server with `lightning-ppo serve` from the trainer's "
                "lightning_ppo version",
            )
        config = policy.config
        ours = list(getattr(config, "architectures", None) or [])
        if ours and described["architectures"] != ours:
            raise server.error(
                "model",
                f"serves the architecture {described['architectures']} ({described['model']}), "
                f"the policy's is {ours}",
            )
        if described["vocab_size"] != config.vocab_size:
            raise server.error(
                "model",
                f"serves a vocabulary of {described['vocab_size']} ({described['model']}), the policy's "
                f"has {config.vocab_size}",
            )
        for key, flag, wanted in (
            ("logprobs_mode", "--logprobs-mode", "processed_logprobs"),
            ("generation_config", "--generation-config", "vllm"),
        ):
            if described[key] != wanted:
                raise server.error("settings", f"runs with {flag} {described[key]}; it needs {flag} {wanted}")
        self._check_tokenizer(server)
        return described

    @property
    def memory(self) -> MemorySync | NcclSync | None:
        """The in-memory transport (``generation.sync_transport``: ``memory``, our gloo group, or
        ``nccl``, vLLM's own), once the servers are known; ``None`` for ``file``."""
        transport = self.config.sync_transport
        if self._memory is None and transport in ("memory", "nccl") and self.described:
            workers = [described["workers"] for described in self.described]
            address = sync_address(self.config.sync_address, self.config.server_urls)
            kind = NcclSync if transport == "nccl" else MemorySync
            self._memory = kind(self.servers, workers, address, self.config.server_timeout)
        return self._memory

    def _check_tokenizer(self, server: ServerClient) -> None:
        ours = self.tokenizer(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        name = self._served_name(server)
        answer = server.post(
            "/tokenize", {"model": name, "prompt": _TOKENIZER_PROBE, "add_special_tokens": False}
        )
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        if theirs != ours:
            raise server.error(
                "tokenizer",
                f"tokenizes {_TOKENIZER_PROBE!r} as {str(theirs)[:80]}, the policy's tokenizer as "
                f"{str(ours)[:80]}: it serves another tokenizer ({name})",
            )

    def _served_name(self, server: ServerClient) -> str:
        answer = server.get("/v1/models")
        try:
            return str(answer["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise server.error("/v1/models", f"lists no model: {str(answer)[:200]!r}") from None

    # --- sampling ------------------------------------------------------------------------------

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Rollout:
        if not self.served_names:
            self.served_names = [self._served_name(server) for server in self.servers]
        version = self._version(self.syncs) if self.syncs else None  # None: this engine never synced
        self._check_versions(version, range(len(self.servers)), since="restarted since")
        prompts = [row[mask].tolist() for row, mask in zip(prompt_ids, prompt_mask.bool(), strict=True)]
        # One request per group of identical prompts, n samples seeded seed + i (as the colocated
        # engine seeds its rows): a group shares one server's prefix cache.
        groups = prompt_groups(prompts)
        seeds = group_seeds(groups)
        connections = self._connected()
        self.shared_json.clear()  # encoded again from this batch's settings
        router = Router(self.shares, first=self.placement.rank, latencies=self.latencies.estimates())
        calls = [
            partial(self._routed, router, connections, index, prompts[start], seed, count)
            for index, ((start, count), seed) in enumerate(zip(groups, seeds, strict=True))
        ]
        self.batch_requests = len(calls)
        try:
            answers = connections.send(calls, self.config.server_timeout, in_flight=router.room())
        except Stalled as stalled:
            index, held = router.holding(stalled.waiting)
            server = self.servers[index]
            raise server.error(
                "/v1/completions",
                f"no completion of {held} request(s) within {server.timeout:g} s (generation.server_timeout)",
            ) from None
        self.latencies.record(router.took)  # a batch that failed measures nothing
        # A server restarted while the batch was out answered (a request sent again on a new
        # connection, or sent later) with its startup checkpoint, and the next sync would load it
        # again unseen. A version changes only by a sync (a new one) or a restart (none): one that
        # holds the batch's now held it throughout.
        self._check_versions(
            version,
            router.used(),
            since="restarted while this batch was out (none of it is trained on)",
        )
        tokens = [row for answer in answers for row, _ in answer]
        logprobs = [row for answer in answers for _, row in answer]
        pad = self.hf_generation.pad_token_id
        return completions_to_rollout(prompt_ids, prompt_mask, tokens, logprobs, self._stop_id(), pad)

    def _connected(self) -> Connections:
        """The engine's connections, made anew after :meth:`close`, in a forked child, or for
        another ``max_in_flight``. After :meth:`close`, only the main thread (a user's own call) or
        the next sync opens them again: a sampling job that a failed fit left on its background
        thread stops here, rather than open connections that nothing would close."""
        with self._connections_lock:
            if self._closed and threading.current_thread() is not threading.main_thread():
                raise GenerationServerError(
                    "the vllm_server engine was closed as its fit ended: a sampling job left from that fit "
                    "stops here (the next fit's first sync opens the connections again)"
                )
            self._closed = False
            stale = self._connections
            if stale is None or not stale.serves(self.max_in_flight):
                self._connections = Connections(self.servers, self.max_in_flight)
                if stale is not None:
                    stale.close()
            return self._connections

    @property
    def max_in_flight(self) -> int:
        """The most requests this rank has in flight on any one server (its connections per server)."""
        return max(self.shares)

    @max_in_flight.setter
    def max_in_flight(self, limit: int) -> None:
        """The same share on every server (a benchmark's or a test's own limit)."""
        self.shares = [limit] * len(self.servers)

    def close(self) -> None:
        """Closes the connections to the servers (a batch still out is cancelled); the next sync, or
        a batch asked for on the main thread, opens them again, its first batch routed as if no
        server were measured yet (:mod:`.routing`); the NCCL weights group
        (``sync_transport: nccl``) is shut down on both sides, the next sync opens another. Called as
        each fit ends (:mod:`lightning_ppo.rollout.fit_callbacks`), on the fit's thread while a job
        may still run."""
        with self._connections_lock:
            connections, self._connections, self._closed = self._connections, None, True
        if connections is not None:
            connections.close()
        # A later fit measures the servers anew: one may have been restarted or freed meanwhile.
        self.latencies = Latencies(len(self.servers))
        if isinstance(self._memory, NcclSync):  # NCCL's communicator and store: the next fit opens anew
            self._memory.close()

    def _version(self, syncs: int) -> str:
        return f"{self.tag}/{syncs}"

    def _check_versions(self, version: str | None, indices: Iterable[int], since: str) -> None:
        """Each server of ``indices`` holds ``version``, the weights of this engine's last sync (a
        server restarted ``since`` serves its startup checkpoint, and answers as if nothing happened)."""
        if version is None:  # this engine never synced: nothing of its own to look for
            return
        for server in (self.servers[index] for index in indices):
            held = server.rpc("lppo_version")
            if held != version:
                raise server.error(
                    "weights version",
                    f"holds weights version {held or 'none (its startup checkpoint)'}, not this run's last "
                    f"sync ({version}): {since}, or synced by another run? Resume the run (--ckpt_path "
                    "last) to sync it again",
                )

    async def _routed(
        self, router: Router, connections: Connections, index: int, prompt: list[int], seed: int, n: int
    ) -> list[tuple[list[int], list[float]]]:
        """Request ``index`` of the batch on the server expected to answer it first (:mod:`.routing`),
        its latency measured: its samples come from there, a request asked again exactly too."""
        server = await router.take(index)
        start, seconds = time.perf_counter(), None
        try:
            samples = await self._complete(connections.sessions[server], prompt, seed, n)
            seconds = time.perf_counter() - start
            return samples
        finally:
            router.give_back(server, seconds)

    async def _complete(
        self, session: ServerSession, prompt: list[int], seed: int, n: int, exact: bool = False
    ) -> list[tuple[list[int], list[float]]]:
        """``n`` samples of ``prompt`` from ``session``'s server: each one's tokens and log-probs
        (``exact``: suppressed tokens sent as ``allowed_token_ids`` whatever their number)."""
        server = session.client
        answer = await self._post(session, self.servers.index(server), prompt, seed, n, exact)
        try:  # ids in the vocabulary, finite log-probs, no more than asked for (:mod:`.answers`)
            samples = samples_of(answer, n, self.vocab_size, self.hf_generation.max_new_tokens)
        except BadAnswer as err:
            raise server.error("/v1/completions", str(err)) from None
        return samples if exact else await self._exact_again(session, prompt, seed, samples)

    async def _post(
        self, session: ServerSession, index: int, prompt: list[int], seed: int, n: int, exact: bool
    ) -> Any:
        """The server's answer to the completion request. A server that refuses ``logit_bias`` (vLLM
        with speculative decoding: "not yet supported with speculative decoding", an HTTP 400) is
        asked again with ``allowed_token_ids``, which it applies, and is sent those from then on:
        before the smaller encoding (:mod:`.suppress`) every request was sent them."""
        exact = exact or index in self.bias_refused
        request = self._encoded(self.served_names[index], prompt, seed, n, exact)
        # The socket may wait behind the whole batch (vLLM answers a request when it is done); a batch
        # that makes no progress is stopped after server_timeout (server_batch).
        timeout = self.config.server_timeout * self.batch_requests
        self.requests_sent[index] += 1  # on the engine's loop, one request at a time: no lock
        try:
            return await session.post("/v1/completions", request, timeout=timeout)
        except GenerationServerError as err:
            if exact or not self._suppression().biased or not _refuses_bias(err):
                raise
        self.bias_refused.add(index)
        self.requests_sent[index] += 1
        request = self._encoded(self.served_names[index], prompt, seed, n, exact=True)
        return await session.post("/v1/completions", request, timeout=timeout)

    async def _exact_again(
        self,
        session: ServerSession,
        prompt: list[int],
        seed: int,
        samples: list[tuple[list[int], list[float]]],
    ) -> list[tuple[list[int], list[float]]]:
        """``samples`` with each one that holds a suppressed id requested again, exactly.

        A request that sent ``logit_bias`` (:mod:`.suppress`) leaves a suppressed token
        e^-100 of its odds, so it is drawn where the model puts its logit about 100 above the rest;
        the trainer's log-probs give it -inf, and the promise is that it is never sampled. Such a
        sample goes again alone under ``allowed_token_ids``, with the seed vLLM gave it in its group
        (seed + i): it is the sample an exact request would have drawn, the same again on a resume.
        Once: a server that returns a suppressed id under ``allowed_token_ids`` does not apply them.
        The request goes in this request's place in the batch, inside the batch's one bound.
        """
        suppression = self._suppression()
        for i, (tokens, _) in enumerate(samples):
            if suppression.first_in(tokens) is None:
                continue
            self.exact_requests += 1
            samples[i] = (await self._complete(session, prompt, seed + i, 1, exact=True))[0]
            token = suppression.first_in(samples[i][0])
            if token is not None:
                raise session.client.error(
                    "/v1/completions",
                    f"sampled the suppressed token id {token} under allowed_token_ids: it ignores them",
                )
        return samples

    def _suppression(self) -> Suppression:
        return suppression(self.hf_generation.suppress_tokens, self.vocab_size)

    def _stop_id(self) -> int | None:
        return self.hf_generation.eos_token_id

    def _request(
        self, model: str, prompt: list[int], seed: int, n: int = 1, exact: bool = False
    ) -> dict[str, Any]:
        """One completion request under exactly ``hf_generation``'s settings (nothing from the server's
        defaults: it runs with ``--generation-config vllm``); the suppressed tokens in the smaller
        encoding, or ``allowed_token_ids`` where ``exact`` (:mod:`.suppress`). Sent as
        :meth:`_encoded` encodes it."""
        return {"model": model, "prompt": prompt, "n": n, "seed": seed, **self._shared(exact)}

    def _encoded(self, model: str, prompt: list[int], seed: int, n: int, exact: bool) -> bytes:
        """:meth:`_request`'s JSON, byte for byte as ``json.dumps`` makes it, the fields every request
        of the batch shares encoded once a batch (the allowed ids of an exact request are a megabyte
        of JSON at 150k tokens: 23 ms each): bytes, which the garbage collector does not track, wait
        for the answer, not a dict."""
        shared = self.shared_json.get((model, exact))
        if shared is None:  # never empty: max_tokens and the others are always sent
            shared = json.dumps(self._shared(exact))[1:-1]
            self.shared_json[(model, exact)] = shared
        own = f'"model": {json.dumps(model)}, "prompt": {json.dumps(prompt)}, "n": {json.dumps(n)}'
        return f'{{{own}, "seed": {json.dumps(seed)}, {shared}}}'.encode()

    def _shared(self, exact: bool) -> dict[str, Any]:
        """The fields of :meth:`_request` that every request of a batch shares."""
        gen = self.hf_generation
        sampled = bool(gen.do_sample)
        stop = self._stop_id()
        return {
            "max_tokens": gen.max_new_tokens,
            "temperature": gen.temperature if sampled else 0.0,
            "top_k": (gen.top_k or -1) if sampled else -1,
            "top_p": gen.top_p if sampled else 1.0,
            # Only our stop token ends a response, as in HF generate with eos_token_id=stop.
            "ignore_eos": True,
            "stop_token_ids": [stop] if stop is not None and 0 <= stop < self.vocab_size else [],
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            **self._suppression().fields(exact),
        }


def _refuses_bias(err: GenerationServerError) -> bool:
    """A request refused (HTTP 400) for its ``logit_bias``."""
    return err.what.startswith("HTTP 400") and "logit_bias" in err.what


def _sync_failure(err: Exception) -> str:
    """One line for a sync that failed outside the HTTP calls (writing the weights file, most often)."""
    return f"weight sync failed: {type(err).__name__}: {err} (generation.sync_transport, sync_dir)"
