"""How the server engine spreads a batch over several servers: a limit of requests in flight per
server (``generation.server_max_in_flight``), each request to the server with the fewest of this
rank's in flight, the ranks sharing the limit. Fake servers on 127.0.0.1 (threads, no vLLM) that
hold requests until an event of the test, never a time: what they record is what the client sent
them at once, and nothing is timed (benchmarks/servers.py --only routing times it)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from lightning_ppo import GenerationConfig
from lightning_ppo.rollout.engines import Placement
from lightning_ppo.rollout.engines.server import VLLMServerEngine
from lightning_ppo.rollout.engines.server.client import GenerationServerError
from lightning_ppo.rollout.engines.server.routing import rank_shares
from lightning_ppo.rollout.sampling import hf_generation_config
from lightning_ppo.runs.errors import UsageError
from tests.test_server_engine import _Backlogged, _Quiet


@dataclass
class Floor:
    """What several fake servers saw together: each one's requests in flight now and at most, and
    each one's answers; ``ready(server)`` says when a request held at ``server`` may be answered
    (once true, true for good: a held request looks again only when it wakes)."""

    servers: int
    in_flight: list[int] = field(init=False)
    peaks: list[int] = field(init=False)
    answered: list[int] = field(init=False)
    arrived: int = 0
    ready: Callable[[Floor, int], bool] = lambda floor, server: True
    hold_s: float = 60.0  # the bound on any hold: only a test that fails reaches it
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.in_flight, self.peaks, self.answered = [0] * self.servers, [0] * self.servers, [0] * self.servers


class _Held(_Quiet):
    """A completion held until its floor says it may go, then answered with [3, 4] per sample;
    counted in flight from its arrival to its answer."""

    floor: Floor
    index: int

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        floor, index = self.floor, self.index
        with floor.changed:
            floor.arrived += 1
            floor.in_flight[index] += 1
            floor.peaks[index] = max(floor.peaks[index], floor.in_flight[index])
            floor.changed.notify_all()
            floor.changed.wait_for(lambda: floor.ready(floor, index), timeout=floor.hold_s)
        choice = {"token_ids": [3, 4], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
        body = json.dumps({"choices": [{**choice, "index": i} for i in range(request["n"])]}).encode()
        with floor.changed:  # counted out before the answer leaves: the client may send the next
            floor.in_flight[index] -= 1
            floor.answered[index] += 1
            floor.changed.notify_all()
        self.reply(body)


@pytest.fixture
def servers() -> Iterator[Callable[[Floor], list[str]]]:
    """Starts a fake server per server of a floor; every one is stopped at the test's end."""
    started: list[tuple[_Backlogged, Floor]] = []

    def start(floor: Floor) -> list[str]:
        urls = []
        for index in range(floor.servers):
            handler = type("Held", (_Held,), {"floor": floor, "index": index})
            server = _Backlogged(("127.0.0.1", 0), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            started.append((server, floor))
            urls.append(f"http://127.0.0.1:{server.server_port}")
        return urls

    yield start
    for server, floor in started:
        floor.hold_s = 0.0
        with floor.changed:
            floor.ready = lambda floor, index: True
            floor.changed.notify_all()
        server.shutdown()
        server.server_close()


def _prompts(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` distinct prompts (one request each)."""
    ids = torch.tensor([[i // 100, i // 10 % 10, i % 10] for i in range(count)])
    return ids, torch.ones_like(ids)


def _many(
    tiny_digits: Path, urls: list[str], placement: Placement, timeout: float = 60, **settings
) -> VLLMServerEngine:
    """An engine on ``urls`` as after its first sync, for a fake server that keeps no weights version."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_digits))
    config = GenerationConfig(
        max_new_tokens=4,
        stop_token="=",
        engine="vllm_server",
        server_urls=urls,
        server_timeout=timeout,
        **settings,
    )
    hf = hf_generation_config(config, tokenizer.convert_tokens_to_ids("="), tokenizer.pad_token_id)
    engine = VLLMServerEngine(config, hf, placement, tokenizer, len(tokenizer))
    engine.served_names, engine.syncs = ["policy"] * len(urls), 0
    return engine


def test_every_server_fills_to_its_limit_in_one_wave(servers, tiny_digits):
    """32 prompts on 4 servers, 8 in flight per server: all 32 out at once, 8 on each (each server
    holds its requests until all 32 have arrived). Before, the cap of 8 was the rank's over all
    servers: 2 on each, in 4 waves (each wave answered only at its holds' bound)."""
    floor = Floor(4, ready=lambda floor, index: floor.arrived >= 32, hold_s=3.0)
    engine = _many(tiny_digits, servers(floor), Placement())
    engine.max_in_flight = 8  # per server
    rollout = engine.generate(*_prompts(32))
    engine.close()
    assert rollout.response_ids.shape == (32, 2)
    assert floor.peaks == [8, 8, 8, 8], floor.peaks
    assert engine.requests_sent == [8, 8, 8, 8]


def test_a_slow_server_gets_fewer_requests(servers, tiny_digits):
    """2 servers, 2 in flight each, 20 prompts; server 0 answers only once server 1 has answered 18
    (it holds the first 2 it gets). Each request goes to the server with the fewest in flight
    below the limit: server 0 keeps its 2, server 1 takes the other 18. Before, request i went to
    server i mod 2 whatever either held: 10 each, server 0's waiting at the hold's bound."""
    floor = Floor(2, ready=lambda floor, index: index == 1 or floor.answered[1] >= 18, hold_s=2.0)
    engine = _many(tiny_digits, servers(floor), Placement())
    engine.max_in_flight = 2
    rollout = engine.generate(*_prompts(20))
    engine.close()
    assert rollout.response_ids.shape == (20, 2)
    assert engine.requests_sent == [2, 18]
    assert floor.peaks[0] == 2  # the slow one held as many as it may


def test_a_hung_server_among_others_is_named_with_the_requests_it_holds(servers, tiny_digits):
    """Server 1 never answers (until the test ends), server 0 at once: server 1 keeps its 3 requests,
    server 0 answers the other 27, and the batch stops after one server_timeout of silence naming
    server 1 and its 3 (not the first server, nor every request of the batch)."""
    floor = Floor(2, ready=lambda floor, index: index == 0)
    urls = servers(floor)
    engine = _many(tiny_digits, urls, Placement(), timeout=2.0)
    engine.max_in_flight = 3
    with pytest.raises(GenerationServerError) as caught:
        engine.generate(*_prompts(30))
    engine.close()
    assert str(caught.value) == (
        f"generation server {urls[1]} (/v1/completions): no completion of 3 request(s) within 2 s "
        "(generation.server_timeout)"
    )
    assert floor.answered[0] == 27


def test_two_ranks_share_each_servers_limit(servers, tiny_digits):
    """Two ranks (two engines, as two DDP ranks would be, on threads) on 2 servers with
    ``server_max_in_flight: 8``: each rank sends at most 4 to a server, so each server holds 8 from
    both at most, and holds 8 (its servers hold the first 16 requests until all 16 have come: with
    a limit of 8 per rank per server, 32 would come at once, 16 on each server)."""
    floor = Floor(2, ready=lambda floor, index: floor.arrived >= 16)
    urls = servers(floor)
    ranks = [Placement(world_size=2, rank=rank) for rank in (0, 1)]
    engines = [_many(tiny_digits, urls, placement, server_max_in_flight=8) for placement in ranks]
    assert [engine.max_in_flight for engine in engines] == [4, 4]
    shapes: list[object] = []

    def sample(engine: VLLMServerEngine) -> None:
        try:
            shapes.append(tuple(engine.generate(*_prompts(16)).response_ids.shape))
        except Exception as err:  # noqa: BLE001  (said by the assertion below)
            shapes.append(err)

    threads = [threading.Thread(target=sample, args=(engine,)) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for engine in engines:
        engine.close()
    assert shapes == [(16, 2), (16, 2)], shapes
    assert floor.peaks == [8, 8], floor.peaks
    assert [engine.requests_sent for engine in engines] == [[8, 8], [8, 8]]


def _ranks_sample(engines: list[VLLMServerEngine], prompts: int) -> list[object]:
    """Each engine (a rank, on a thread of its own) samples ``prompts`` prompts at once; each rank's
    shape, or its error."""
    shapes: list[object] = []

    def sample(engine: VLLMServerEngine) -> None:
        try:
            shapes.append(tuple(engine.generate(*_prompts(prompts)).response_ids.shape))
        except Exception as err:  # noqa: BLE001  (said by the caller's assertion)
            shapes.append(err)

    threads = [threading.Thread(target=sample, args=(engine,)) for engine in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for engine in engines:
        engine.close()
    return shapes


@pytest.mark.parametrize(
    ("ranks", "limit"),
    [(3, 8), (4, 2), (2, 1)],
    ids=["3-ranks-limit-8", "4-ranks-limit-2", "2-ranks-limit-1"],
)
def test_ranks_that_do_not_divide_the_limit_hold_each_server_to_it(servers, tiny_digits, ranks, limit):
    """2 servers, ``ranks`` ranks that do not divide ``server_max_in_flight`` or outnumber it: every
    rank's requests on a server together are the limit, never more. The servers hold what they get
    until one request more than the limit could have come (never, where the limit holds: they let
    go at the hold's bound). Before, each rank sent limit / ranks rounded up to every server:
    3 ranks at 8 held 9 on each, 4 ranks at 2 held 4, 2 ranks at 1 held 2."""
    floor = Floor(2, ready=lambda floor, index: floor.arrived > 2 * limit, hold_s=1.0)
    urls = servers(floor)
    placements = [Placement(world_size=ranks, rank=rank) for rank in range(ranks)]
    engines = [_many(tiny_digits, urls, placement, server_max_in_flight=limit) for placement in placements]
    shapes = _ranks_sample(engines, 6)
    assert shapes == [(6, 2)] * ranks, shapes
    assert max(floor.peaks) == limit, floor.peaks
    assert sum(sum(engine.requests_sent) for engine in engines) == 6 * ranks


def test_every_servers_limit_is_dealt_out_whole_over_the_ranks():
    """Limits 1-12, 1-9 ranks, 1-5 servers: each server's shares add up to its limit exactly, and
    the ranks' totals differ by one at most; where there are fewer slots than ranks, every rank
    still has one (those beyond the slots queued on a server: the only excess)."""
    for limit, ranks, servers in itertools.product(range(1, 13), range(1, 10), range(1, 6)):
        shares = [rank_shares(limit, ranks, rank, servers) for rank in range(ranks)]
        totals = [sum(share) for share in shares]
        on_each = [sum(share[server] for share in shares) for server in range(servers)]
        case = (limit, ranks, servers, shares)
        assert min(totals) >= 1, case
        if limit * servers >= ranks:
            assert on_each == [limit] * servers, case
            assert max(totals) - min(totals) <= 1, case
        else:
            assert sum(on_each) == ranks and max(on_each) - min(on_each) <= 1, case


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_the_limit_per_server_is_checked(value):
    with pytest.raises(UsageError, match=r"generation.server_max_in_flight must be an integer >= 1"):
        GenerationConfig(engine="vllm_server", server_urls=["http://h:1"], server_max_in_flight=value)


def test_a_batch_reads_each_servers_key_once(servers, tiny_digits, tmp_path, monkeypatch):
    """32 prompts on 4 servers, twice, with no key anywhere (an open server): each server's key is
    looked for once a batch, 8 lookups (a key file named and opened each time), where each request
    looked for it before: 64. A request refused with 401 still reads it again
    (test_server_keys::test_a_server_restarted_at_its_address_is_reached_with_its_new_key)."""
    from lightning_ppo.rollout.engines.server import client

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    looked: list[str] = []
    real = client.server_key
    monkeypatch.setattr(client, "server_key", lambda url: looked.append(url) or real(url))
    floor = Floor(4)
    urls = servers(floor)
    engine = _many(tiny_digits, urls, Placement())
    engine.max_in_flight = 8
    for _ in range(2):
        assert engine.generate(*_prompts(32)).response_ids.shape == (32, 2)
    engine.close()
    assert sum(floor.answered) == 64
    assert sorted(looked) == sorted(urls * 2)


def test_a_server_measured_slower_gets_fewer_requests_in_the_next_batch(servers, tiny_digits):
    """2 servers, 4 in flight each, 8 prompts a batch; server 0 holds every request 1.5 s, server 1
    answers at once. The first batch, nothing measured yet, fills both evenly (4 and 4). The second
    sends all 8 to server 1: waiting for its slots (milliseconds) is sooner than server 0's 1.5 s.
    Before, the second batch went 4 and 4 as the first: the slow server held half of it."""
    floor = Floor(2, ready=lambda floor, index: index == 1, hold_s=1.5)
    engine = _many(tiny_digits, servers(floor), Placement())
    engine.max_in_flight = 4
    assert engine.generate(*_prompts(8)).response_ids.shape == (8, 2)
    assert engine.requests_sent == [4, 4]
    assert engine.generate(*_prompts(8)).response_ids.shape == (8, 2)
    engine.close()
    assert engine.requests_sent == [4, 12]
    assert floor.answered == [4, 12]


def test_a_later_fit_measures_the_servers_anew(servers, tiny_digits):
    """Server 0 measured 1.5 s beside server 1 at once in a fit; the fit ends (the engine closed, as
    CloseEngine does), and the next fit's first batch fills both evenly again (4 and 4): between two
    fits a server may have been restarted, moved or freed of another job. Before, the next fit went
    on routing by the last fit's figures: all 8 to server 1, server 0 left out for 8 batches."""
    floor = Floor(2, ready=lambda floor, index: index == 1, hold_s=1.5)
    engine = _many(tiny_digits, servers(floor), Placement())
    engine.max_in_flight = 4
    assert engine.generate(*_prompts(8)).response_ids.shape == (8, 2)
    engine.close()  # the fit ended
    assert engine.generate(*_prompts(8)).response_ids.shape == (8, 2)
    engine.close()
    assert engine.requests_sent == [8, 8]


def test_a_request_waits_for_a_faster_servers_slot_rather_than_go_to_a_slow_one():
    """Latencies 2 s, 0.5 s, 0.5 s, 0.5 s, 4 slots each: 12 requests fill the fast servers in turn,
    the 13th waits for server 1 (server 0 has room, but a fast one's next slot is sooner) and takes
    its slot as one of its requests is answered. Servers within a quarter of the best fill evenly.
    Before, a request went to the server with the fewest in flight: server 0."""
    from lightning_ppo.rollout.engines.server.routing import Router

    async def route(latencies: list[float], requests: int) -> tuple[list[int], Router, asyncio.Future]:
        router = Router([4, 4, 4, 4], latencies=latencies)
        first = [await router.take(index) for index in range(requests)]
        waiting = asyncio.ensure_future(router.take(requests))
        await asyncio.sleep(0)
        return first, router, waiting

    async def slow_one() -> tuple[list[int], bool, int, list[int]]:
        first, router, waiting = await route([2.0, 0.5, 0.5, 0.5], 12)
        held = waiting.done()
        router.give_back(1, 0.5)
        return first, held, await asyncio.wait_for(waiting, 10), router.in_flight

    first, held, then, in_flight = asyncio.run(slow_one())
    assert first == [1, 2, 3] * 4 and not held and then == 1
    assert in_flight == [0, 4, 4, 4]

    async def alike() -> list[int]:
        first, router, waiting = await route([0.5, 0.55, 0.6, 0.5], 12)
        return first + [await asyncio.wait_for(waiting, 10)]

    assert asyncio.run(alike()) == [0, 1, 2, 3] * 3 + [0]


def test_a_server_left_without_requests_is_tried_again_after_a_while():
    """A server measured at 2 s beside one at 0.5 s keeps its 2 s while left without requests, for
    FORGET_AFTER batches; then it is estimated as the slowest of the others (0.5 s), so the next
    batch sends it requests and measures it again."""
    from lightning_ppo.rollout.engines.server.routing import FORGET_AFTER, Latencies

    latencies = Latencies(2)
    assert latencies.estimates() == [1.0, 1.0]
    latencies.record([[2.0, 1.0, 3.0], [0.5]])
    assert latencies.estimates() == [2.0, 0.5]
    for _ in range(FORGET_AFTER - 1):
        latencies.record([[], [0.4, 0.6]])
    assert latencies.estimates() == [2.0, 0.5]
    latencies.record([[], [0.7]])
    assert latencies.estimates() == [0.7, 0.7]
