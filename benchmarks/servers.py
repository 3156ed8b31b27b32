"""Generation on a vLLM server against the colocated vLLM engine, on 2 CPU cores.

    .venv-vllm/bin/python -m benchmarks.servers                 # both tables
    .venv-vllm/bin/python -m benchmarks.servers --iterations 3 --sizes 4x256   # a smoke run

**Seconds per iteration.** The same PPO run (a 4 x 256 GPT-2, the quickstart's task, batch 64, 16
new tokens, GAE, 2 epochs x 2 minibatches, fp32), each variant in a process of its own:
``colocated`` (``generation.engine: vllm``, the engine inside the trainer, both on core 0) and
``server`` (``vllm_server``: the trainer on core 0, one ``lightning-ppo serve`` server on core 1).
Each gets one thread per process; the first iteration (vLLM's warm-up) is left out.

**One weight sync against the model's size.** For GPT-2s of several sizes: the colocated engine's
in-place reload, and the server's whole sync through a file (``sync_transport: file``: write the
safetensors file, the server's load) and in memory (``memory``: the broadcast over the gloo group,
the server's load as the buckets arrive), each measured in the same run, and the memory sync with
the checksums (``verify_sync``: the server's checksums and the trainer's comparison).

**One rollout of 512 prompts x 64 new tokens** on one server: at most 64 requests in flight per
rank (as before issue 40) against the default 256, alternated in the same run;
and 64 prompts x 8 samples sent as 512 requests against 64 grouped requests of ``n`` 8.
``--before DIR`` runs each round of it twice, alternated, against the same server: with the
``lightning_ppo`` of the checkout at ``DIR`` (``git worktree add DIR COMMIT``: the engine as it
was at COMMIT) and with this one's, the benchmark's code this one's both times. Each way's trainer
CPU seconds are its process's (every thread's), less noisy than the wall time on a shared machine::

    git worktree add /tmp/before HEAD~1
    .venv-vllm/bin/python -m benchmarks.servers --only rollouts --rounds 3 --before /tmp/before

**Routing over several servers** (``--only routing``, no vLLM: ``.venv/bin/python`` runs it): 1024
prompts on 4 fake servers that answer each request after a fixed service time (0.5 s or 2 s, any
number at once; then one of them 4x slower), with the engine's defaults, after one batch that
opens the connections and measures each server's latency (the routing's); the seconds of one
batch, the trainer's CPU seconds for it (its process's, every thread's, the objects of its start
frozen as a fit freezes them), each server's most requests in flight, and the requests each got.
With ``--before DIR`` each round runs DIR's engine too, alternated, against the same servers::

    git worktree add /tmp/before HEAD~1
    .venv/bin/python -m benchmarks.servers --only routing --rounds 3 --before /tmp/before
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import pinned_child, timed_digits_fit
from benchmarks.flags import at_least_one

ROOT = Path(__file__).resolve().parents[1]


def _spec(size: str):
    from lightning_ppo.tasks.tiny import TinyModelSpec

    layers, width = (int(x) for x in size.split("x"))
    return TinyModelSpec(n_layer=layers, n_embd=width, n_head=width // 64, n_positions=128)


def _module(policy: str, engine: str, url: str | None, verify: bool = False, transport: str = "memory"):
    import torch

    from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
    from lightning_ppo.tasks.digits import DigitsReward

    servers = {"server_urls": [url], "verify_sync": verify, "sync_transport": transport} if url else {}
    generation = GenerationConfig(
        max_new_tokens=16, stop_token="=", engine=engine, gpu_memory_utilization=0.1, **servers
    )
    return PPOLightningModule(
        policy=policy,
        reward_fn=DigitsReward(),
        ppo=PPOConfig(ppo_epochs=2, num_minibatches=2),
        generation=generation,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
    )


def child_iterations(policy: str, engine: str, url: str | None, iterations: int) -> list[float]:
    """Seconds of each PPO iteration of a run (this process: one thread, core 0)."""
    times = timed_digits_fit(_module(policy, engine, url), iterations + 1, 64)
    return times[1:]


def child_syncs(policy: str, engine: str, url: str | None, repeats: int) -> dict[str, float]:
    """Median seconds of one sync (the first, with its one-off checks, left out)."""
    from functools import partial

    import torch

    from lightning_ppo.rollout.engines.server import engine as server_module

    results = {}
    variants = [("file", False), ("memory", False), ("memory", True)] if url else [("memory", False)]
    if url:
        variants.insert(0, ("file before", False))  # as before issue 40: the trainer's checksums every sync
    real_write = server_module.write_weights
    for transport, verify in variants:
        # "file before": the trainer's checksums computed at every sync, as before issue 40
        always = partial(_write_with_checksums, real_write)
        server_module.write_weights = always if transport == "file before" else real_write
        module = _module(policy, engine, url, verify, transport.split()[0])
        engine_ = module.engine
        engine_.sync_weights(module.policy)
        took = []
        for _ in range(repeats):
            with torch.no_grad():
                next(module.policy.parameters()).add_(1e-3)
            start = time.perf_counter()
            engine_.sync_weights(module.policy)
            took.append(time.perf_counter() - start)
        results[transport + (" verified" if verify else "")] = statistics.median(took)
    return results


# The ways child_rollouts sends the batch, in its order (an earlier checkout's child names them its own
# way: they are read in this order).
WAYS = ["64 in flight", "256 in flight", "64 x 8, a request per row", "64 x 8, grouped (n = 8)"]


def child_rollouts(policy: str, url: str, rounds: int) -> dict[str, list[float]]:
    """Seconds of one 512-prompt x 64-token rollout under each way of sending it, alternated, and
    the process's CPU seconds in it (``seconds``, ``cpu``: lists by way)."""
    import torch
    from transformers import AutoTokenizer

    from lightning_ppo import GenerationConfig
    from lightning_ppo.models.loading import load_causal_lm
    from lightning_ppo.rollout.engines import Placement
    from lightning_ppo.rollout.engines.server import engine as server_module
    from lightning_ppo.rollout.sampling import hf_generation_config

    tokenizer = AutoTokenizer.from_pretrained(policy)
    config = GenerationConfig(max_new_tokens=64, engine="vllm_server", server_urls=[url], server_timeout=600)
    # a stop id past the vocabulary: no response stops early, every one is 64 tokens
    hf = hf_generation_config(config, len(tokenizer), tokenizer.pad_token_id)
    engine = server_module.VLLMServerEngine(config, hf, Placement(), tokenizer, len(tokenizer))
    engine.sync_weights(load_causal_lm(policy))
    distinct = torch.randint(0, 10, (512, 6))
    grouped = torch.randint(0, 10, (64, 6)).repeat_interleave(8, dim=0)
    mask = torch.ones(512, 6, dtype=torch.long)
    cap = engine.max_in_flight  # the default: 256 (per rank before issue 50, per server since)
    sent = [(64, distinct, False), (cap, distinct, False), (cap, grouped, True), (cap, grouped, False)]
    ways = dict(zip(WAYS, sent, strict=True))
    times: dict[str, list[float]] = {name: [] for name in ways}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    real_groups = server_module.prompt_groups
    for _ in range(rounds):
        for name, (in_flight, prompts, per_row) in ways.items():
            engine.max_in_flight = in_flight
            server_module.prompt_groups = (
                (lambda rows: [(i, 1) for i in range(len(rows))]) if per_row else real_groups
            )
            start, start_cpu = time.perf_counter(), time.process_time()
            engine.generate(prompts, mask)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    server_module.prompt_groups = real_groups
    return {"seconds": times, "cpu": cpu}


# The fake servers' service times of each routing scenario, in seconds per request: the review's
# 0.5 s (where the client's own HTTP work per request is a large share of a batch's time), and 2 s.
SCENARIOS = {
    "4 x 0.5 s": [0.5] * 4,
    "4 x 0.5 s, one 4x slower": [2.0, 0.5, 0.5, 0.5],
    "4 x 2 s": [2.0] * 4,
    "4 x 2 s, one 4x slower": [8.0, 2.0, 2.0, 2.0],
}
ROUTED_PROMPTS = 1024


def child_routing(policy: str, urls: list[str], rounds: int) -> dict[str, list]:
    """Seconds of each of ``rounds`` batches of ``ROUTED_PROMPTS`` distinct prompts over ``urls`` (after
    one that opens the connections, left out), with this checkout's engine at its defaults, and the
    requests it sent each server."""
    import torch
    from transformers import AutoTokenizer

    from lightning_ppo import GenerationConfig
    from lightning_ppo.rollout.engines import Placement
    from lightning_ppo.rollout.engines.server import engine as server_module
    from lightning_ppo.rollout.sampling import hf_generation_config

    tokenizer = AutoTokenizer.from_pretrained(policy)
    config = GenerationConfig(max_new_tokens=16, engine="vllm_server", server_urls=urls, server_timeout=60)
    hf = hf_generation_config(config, len(tokenizer), tokenizer.pad_token_id)
    engine = server_module.VLLMServerEngine(config, hf, Placement(), tokenizer, len(tokenizer))
    engine.served_names, engine.syncs = ["policy"] * len(urls), 0  # the fake servers hold no version
    ids = torch.tensor([[i // 1000, i // 100 % 10, i // 10 % 10, i % 10] for i in range(ROUTED_PROMPTS)])
    mask = torch.ones_like(ids)
    thawed = _freeze_as_a_fit_does()
    engine.generate(ids, mask)
    sent = list(engine.requests_sent)
    seconds, cpu = [], []
    for _ in range(rounds):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.generate(ids, mask)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    engine.close()
    thawed()
    sent = [now - first for now, first in zip(engine.requests_sent, sent, strict=True)]
    return {"seconds": seconds, "cpu": cpu, "sent": [count // rounds for count in sent]}


def _freeze_as_a_fit_does():
    """The process's objects frozen as a ``vllm_server`` fit freezes them (where this checkout's
    engine does: ``lightning_ppo.rollout.frozen_startup``); what thaws them."""
    try:
        from lightning_ppo.rollout.frozen_startup import HOLDS, FreezeStartupObjects
    except ImportError:  # an engine from before it
        return lambda: None
    if not inspect.signature(HOLDS.take).parameters:  # f2badd6's: no holder named
        HOLDS.take()
        return HOLDS.give_back
    holder = FreezeStartupObjects()  # a fit's callback, as the fit's own would hold it
    HOLDS.take(holder)
    return lambda: HOLDS.give_back(holder)


def routing_table(policy: Path, work: Path, rounds: int, before: Path | None = None) -> None:
    """Each scenario's batch with each checkout's engine, a child per round and checkout, alternated."""
    from benchmarks.fake_servers import FakeServers

    checkouts = {"before": _package_of(before, work), "now": ROOT} if before else {"now": ROOT}
    print(f"\n{ROUTED_PROMPTS} prompts, one batch, fake servers (fixed service time), {rounds} rounds")
    print(
        "| servers | engine | s / batch (median, min-max) | / before | trainer CPU s / batch | "
        "most in flight per server | requests |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for scenario, service in SCENARIOS.items():
        seconds: dict[str, list[float]] = {label: [] for label in checkouts}
        cpu: dict[str, list[float]] = {label: [] for label in checkouts}
        seen: dict[str, tuple[list[int], list[int]]] = {}
        with FakeServers(service, tokens=16) as servers:
            for _ in range(rounds):
                for label, root in checkouts.items():
                    servers.peaks()  # from here on
                    took = _child(["routing", str(policy), "-", ",".join(servers.urls), "1"], root)
                    seconds[label] += took["seconds"]
                    cpu[label] += took["cpu"]
                    seen[label] = (servers.peaks(), took["sent"])
        for label, took in seconds.items():
            median = statistics.median(took)
            ratio = f"{median / statistics.median(seconds['before']):.2f}x" if before else "-"
            spread = f"{median:.2f} ({min(took):.2f}-{max(took):.2f})"
            used = f"{statistics.median(cpu[label]):.2f}"
            peaks, sent = seen[label]
            print(f"| {scenario} | {label} | {spread} | {ratio} | {used} | {peaks} | {sent} |", flush=True)


def rollout_table(policy: Path, work: Path, rounds: int, before: Path | None = None) -> None:
    checkouts = {"before: ": _package_of(before, work), "": ROOT} if before else {"": ROOT}
    times: dict[str, list[float]] = {}
    server = _start_server(policy, work / "server-rollouts.log")
    try:
        for _ in range(rounds):
            for label, root in checkouts.items():
                took = _child(["rollouts", str(policy), "vllm_server", server.url, "1"], root)
                for kind, by_way in took.items():
                    for way, values in by_way.items():
                        times.setdefault(f"{label}{way} {kind}", []).extend(values)
    finally:
        server.stop()
    print(f"\nOne rollout, 512 x 64 new tokens, one server, {rounds} rounds alternated")
    if before:
        _before_and_now(times)
        return
    times = {name[: -len(" seconds")]: took for name, took in times.items() if name.endswith(" seconds")}
    print("| requests | s / rollout (median) | min | max |")
    print("| --- | --- | --- | --- |")
    base = statistics.median(next(iter(times.values())))
    for name, took in times.items():
        median = statistics.median(took)
        print(f"| {name} | {median:.2f} ({median / base:.2f}x) | {min(took):.2f} | {max(took):.2f} |")


def _package_of(checkout: Path, work: Path) -> Path:
    """A folder whose ``lightning_ppo`` is ``checkout``'s and whose ``benchmarks`` is this one's."""
    mixed = work / "before"
    mixed.mkdir(exist_ok=True)
    for name, source in (("lightning_ppo", checkout), ("benchmarks", ROOT)):
        if not (mixed / name).exists():
            (mixed / name).symlink_to(source.resolve() / name)
    return mixed


def _before_and_now(times: dict[str, list[float]]) -> None:
    print(
        "| requests | before: s / rollout (median, min-max) | now | now / before | "
        "trainer CPU s, before | now |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for way in WAYS:
        was, now = times[f"before: {way} seconds"], times[f"{way} seconds"]
        ratio = statistics.median(now) / statistics.median(was)
        cells = [f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})" for t in (was, now)]
        cpu = [statistics.median(times[f"{side}{way} cpu"]) for side in ("before: ", "")]
        print(f"| {way} | {cells[0]} | {cells[1]} | {ratio:.2f}x | {cpu[0]:.2f} | {cpu[1]:.2f} |")


def _write_with_checksums(write, weights, folder, dtype, with_checksums=True):
    return write(weights, folder, dtype, True)


def _start_server(policy: Path, log: Path):
    from lightning_ppo.rollout.engines.server.local_server import LocalServer

    # The server's one thread on core 1, fp32 as the trainer.
    return LocalServer(policy, log, dtype="float32", env={"VLLM_CPU_OMP_THREADS_BIND": "1"}).wait_ready()


def _child(args: list[str], root: Path = ROOT) -> dict:
    """Run this module (``root``'s copy of it) as a child on core 0, one thread; its JSON answer."""
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return pinned_child("benchmarks.servers", args, "0", env, root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=at_least_one, default=10)
    parser.add_argument("--rounds", type=at_least_one, default=2)
    parser.add_argument("--sizes", default="4x256,8x512,12x768")
    parser.add_argument("--child", nargs="*")
    parser.add_argument(
        "--only", choices=["iterations", "syncs", "rollouts", "routing"], help="One table only."
    )
    parser.add_argument("--before", type=Path, help="A checkout to run the rollouts from too, alternated.")
    args = parser.parse_args()
    if args.child:
        kind, policy, engine, url, count = args.child
        url = None if url == "-" else url
        if kind == "iterations":
            print(json.dumps(child_iterations(policy, engine, url, int(count))))
        elif kind == "rollouts":
            print(json.dumps(child_rollouts(policy, url, int(count))))
        elif kind == "routing":
            print(json.dumps(child_routing(policy, url.split(","), int(count))))
        else:
            print(json.dumps(child_syncs(policy, engine, url, int(count))))
        return
    from lightning_ppo.tasks.tiny import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-servers-"))
    sizes = args.sizes.split(",")[: 1 if args.only in ("rollouts", "routing") else None]
    policies = {s: make_tiny_checkpoint(work / s, _spec(s), alphabet="0123456789=") for s in sizes}
    first = policies[sizes[0]]
    if args.only == "rollouts":
        rollout_table(first, work, args.rounds, args.before)
        return
    if args.only == "routing":
        routing_table(first, work, args.rounds, args.before)
        return
    if args.only == "syncs":
        sync_table(policies, work)
        return
    server = _start_server(first, work / "server.log")
    try:
        per_variant: dict[str, list[float]] = {"colocated": [], "server": []}
        for _ in range(args.rounds):
            for name, engine, url in (("colocated", "vllm", "-"), ("server", "vllm_server", server.url)):
                per_variant[name] += _child(["iterations", str(first), engine, url, str(args.iterations)])
    finally:
        server.stop()
    print(
        f"\n{sizes[0]} GPT-2, batch 64 x 16 new tokens, {args.rounds} rounds x {args.iterations} iterations"
    )
    print("| engine | s / iteration (median) | min | max |")
    print("| --- | --- | --- | --- |")
    base = statistics.median(per_variant["colocated"])
    for name, times in per_variant.items():
        median = statistics.median(times)
        print(f"| {name} | {median:.3f} ({median / base:.2f}x) | {min(times):.3f} | {max(times):.3f} |")
    if args.only is None:
        sync_table(policies, work)
        rollout_table(first, work, args.rounds, args.before)


def sync_table(policies: dict[str, Path], work: Path) -> None:
    import torch

    from lightning_ppo.models.loading import load_causal_lm

    print(
        "\n| model | parameters | fp32 MiB | colocated reload s | file, before s | file s | "
        "memory s | memory + checksums s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for size, policy in policies.items():
        params = sum(p.numel() for p in load_causal_lm(str(policy)).parameters())
        colocated = _child(["syncs", str(policy), "vllm", "-", "5"])
        server = _start_server(policy, work / f"server-{size}.log")
        try:
            served = _child(["syncs", str(policy), "vllm_server", server.url, "5"])
        finally:
            server.stop()
        mib = params * torch.finfo(torch.float32).bits / 8 / 2**20
        before, file, memory = served["file before"], served["file"], served["memory"]
        print(
            f"| {size} | {params / 1e6:.1f} M | {mib:.0f} | {colocated['memory']:.3f} | {before:.3f} | "
            f"{file:.3f} | {memory:.3f} ({memory / before:.2f}x before, {memory / file:.2f}x file) | "
            f"{served['memory verified']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
