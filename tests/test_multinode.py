"""Two "nodes" of one CPU process each, on this machine, through the real CLI: the multi-node path
(``trainer.num_nodes: 2``) started by ``torchrun`` with a c10d rendezvous (DDP; FSDP2 with a sharded
checkpoint and ``--ckpt_path last``) and by Lightning's own launcher (``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; DDP).

They must train what 2 ranks on one node train (``--trainer.devices 2``, both started at once), bit
for bit: the world size, the backend (gloo) and every collective are the same, only the way the
processes are started and find each other differs (measured: max abs weight difference 0.0 under
DDP and FSDP2). Results are compared by global rank as Lightning sees it: torchrun's c10d
rendezvous numbers the nodes by (host, pid) of their agents, not by the order they were started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import quickstart_fit_args, ranks_process, saver, start_cli

# several processes: run alone (tests/conftest.py); each 15-45 s of new interpreters: make test-long
pytestmark = [pytest.mark.ranks, pytest.mark.long]

FSDP2 = {
    "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
    "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
}
STRATEGIES = {"ddp": "ddp", "fsdp2": json.dumps(FSDP2)}
ITERATIONS, STEPS_PER_ITERATION = 2, 8  # quickstart: ppo_epochs 4 x num_minibatches 2
# test_fsdp2's run: long enough responses that the ranks stop generating apart, accumulation on
TRAINING = (
    *("--model.init_args.generation.max_new_tokens", "24"),
    *("--model.init_args.ppo.gradient_accumulation_steps", "2"),
)
# Every run gets one intra-op thread: the same float kernels in the one-node and the two-node runs
# (oneDNN's reductions may split by thread count), and two "nodes" on one machine share its cores.
THREADS = {"OMP_NUM_THREADS": "1"}
ON_ONE_NODE = ("--trainer.devices", "2")
ON_TWO_NODES = ("--trainer.num_nodes", "2", "--trainer.devices", "1")
ONE_NODE = {0: (0, 0), 1: (0, 1)}  # global rank: (node rank, local rank)
TWO_NODES = {0: (0, 0), 1: (1, 0)}


def fit_args(
    policy: Path, out: Path, root: Path, strategy: str, *extra: str, checkpoints: bool = False
) -> list[str]:
    """The quickstart for ``ITERATIONS`` iterations under ``strategy``, recording each rank's placement,
    samples and trained weights in ``out``; checkpoints (every iteration) under ``root``."""
    recorders = [
        {"class_path": f"tests.helpers.{name}", "init_args": {"out_dir": str(out)}}
        for name in ("TrainedWeightsRecorder", "RankPlacement")
    ]
    callbacks = [*recorders, saver(every_n_iterations=1)] if checkpoints else recorders
    run = (
        *("--trainer.strategy", STRATEGIES[strategy], "--trainer.accelerator", "cpu"),
        *("--trainer.limit_train_batches", str(ITERATIONS)),
        *("--trainer.enable_checkpointing", str(checkpoints).lower()),
    )
    out.mkdir(parents=True, exist_ok=True)
    return quickstart_fit_args(policy, root, callbacks, *run, *TRAINING, *extra, prompts=40000)


@pytest.fixture(scope="module")
def one_node(tiny_digits, tmp_path_factory):
    """``one_node(strategy)``: the records of 2 ranks on one node, run once per strategy for the module
    (both ranks started at once, each told its local rank, as Lightning's launcher tells rank 1)."""
    runs: dict[str, Path] = {}

    def run(strategy: str) -> Path:
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"one_node_{strategy}")
            done = ranks_process(fit_args(tiny_digits, out, out, strategy, *ON_ONE_NODE), **THREADS)
            assert done.returncode == 0, done.stderr[-3000:]
            assert placement(out, "LightningEnvironment") == ONE_NODE
            runs[strategy] = out
        return runs[strategy]

    return run


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_nodes(args: list[str], launcher: str, logs: Path) -> None:
    """Start ``lightning_ppo.cli ARGS`` as node 0 and node 1 of a 2-node job, 1 process each, and wait
    for both to succeed; their output goes to ``logs/node<n>.log``."""
    port, job = free_port(), uuid.uuid4().hex
    nodes = []
    for node in (0, 1):
        if launcher == "torchrun":  # the venv's torchrun: python -m torch.distributed.run
            entry, env = "torch.distributed.run", THREADS
            rendezvous = ("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job)
            argv = ["--nnodes", "2", "--nproc-per-node", "1", *rendezvous, "-m", "lightning_ppo.cli", *args]
        else:  # Lightning's launcher: each node is told its rank and where node 0 listens
            entry, argv = "lightning_ppo.cli", args
            env = {**THREADS, "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with open(logs / f"node{node}.log", "w") as log:
            # a session of its own: torchrun's worker is a child of the node's process, killed with it
            popen = {"stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
            nodes.append(start_cli(argv, entry=entry, env=env, **popen))
    codes = wait_for_nodes(nodes)
    tails = "\n".join(f"node {n}: ...{(logs / f'node{n}.log').read_text()[-3000:]}" for n in (0, 1))
    assert codes == [0, 0], tails


def wait_for_nodes(nodes: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    """The nodes' exit codes. A node that fails leaves the other waiting in a collective or at the
    rendezvous: then (or past ``timeout``) every node's session is killed."""
    deadline = time.monotonic() + timeout
    while any(node.poll() is None for node in nodes):
        if any(node.returncode for node in nodes) or time.monotonic() > deadline:
            for node in nodes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.pid, signal.SIGKILL)
            for node in nodes:
                node.wait()
        time.sleep(0.2)
    return [node.returncode for node in nodes]


def placement(out: Path, environment: str) -> dict[int, tuple[int, int]]:
    """``{global rank: (node rank, local rank)}`` as Lightning placed the ranks of a 2-rank run, each
    rank having been started as ``environment`` (Lightning's cluster environment class) expects."""
    seen = {rank: json.loads((out / f"placement_rank{rank}.json").read_text()) for rank in (0, 1)}
    assert [(p["world_size"], p["environment"]) for p in seen.values()] == [(2, environment)] * 2
    return {rank: (p["node_rank"], p["local_rank"]) for rank, p in seen.items()}


def trained(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights_rank{rank}.pt", weights_only=True)


def lengths(out: Path, rank: int) -> list[int]:
    """The longest response rank ``rank`` sampled in each iteration of the run recorded in ``out``."""
    return json.loads((out / f"lengths_rank{rank}.json").read_text())


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    different = [key for key in got if not torch.equal(got[key], expected[key])]
    worst = max((float((got[k] - expected[k]).abs().max()) for k in different), default=0.0)
    assert not different, f"{len(different)} weights differ, by up to {worst}: {different[:5]}"


def assert_trains_as_one_node(
    weights: list[dict[str, torch.Tensor]], sampled: list[list[int]], one_node: Path, policy: Path
) -> None:
    """Per global rank, the trained ``weights`` are bitwise those of the one-node run, and the longest
    responses ``sampled`` in each iteration are the same; both ranks hold one model, and it moved away
    from the checkpoint it started from."""
    for rank in (0, 1):
        assert_same_weights(weights[rank], trained(one_node, rank))
    assert_same_weights(weights[1], weights[0])
    # Each rank sampled its own responses (ranks are seeded by global rank, not by local rank, which
    # is 0 on both nodes), the same as the one-node rank of its global rank.
    assert sampled == [lengths(one_node, rank) for rank in (0, 1)]
    assert sampled[0] != sampled[1]
    initial = dict(AutoModelForCausalLM.from_pretrained(policy).named_parameters())
    moved = max(
        (weights[0][f"roles.policy.{k}"] - w.detach().double()).abs().max() for k, w in initial.items()
    )
    assert moved > 1e-3  # the equality above is of trained weights, not of the untouched checkpoint


@pytest.mark.parametrize("launcher", ["torchrun", "lightning"])
def test_ddp_on_two_nodes_trains_as_two_ranks_on_one_node(tiny_digits, tmp_path, one_node, launcher):
    """FSDP2 on two nodes is the next test's, under torchrun: its two runs together train the same."""
    run_two_nodes(fit_args(tiny_digits, tmp_path, tmp_path, "ddp", *ON_TWO_NODES), launcher, tmp_path)
    environment = {"torchrun": "TorchElasticEnvironment", "lightning": "LightningEnvironment"}[launcher]
    assert placement(tmp_path, environment) == TWO_NODES  # two nodes to Lightning, local rank 0 on each
    weights = [trained(tmp_path, rank) for rank in (0, 1)]
    sampled = [lengths(tmp_path, rank) for rank in (0, 1)]
    assert_trains_as_one_node(weights, sampled, one_node("ddp"), tiny_digits)


def test_fsdp2_on_two_nodes_checkpoints_into_one_folder_and_resumes_last(tiny_digits, tmp_path, one_node):
    """FSDP2 under torchrun, both nodes on one filesystem: every rank writes its shard into the folder
    global rank 0 named, the run lock is taken and released once, and ``--ckpt_path last`` goes on
    exactly: one iteration, then the second after the resume, train what one node trains in two."""
    first, resumed, root = tmp_path / "first", tmp_path / "resumed", tmp_path / "run"
    # Stopped by max_steps after one iteration, mid-epoch: last.ckpt is where the next run goes on.
    stop = ("--trainer.max_steps", str(STEPS_PER_ITERATION))
    run_two_nodes(
        fit_args(tiny_digits, first, root, "fsdp2", *ON_TWO_NODES, *stop, checkpoints=True), "torchrun", first
    )
    last = ("--ckpt_path", "last")
    run_two_nodes(
        fit_args(tiny_digits, resumed, root, "fsdp2", *ON_TWO_NODES, *last, checkpoints=True),
        "torchrun",
        resumed,
    )
    for out in (first, resumed):
        assert placement(out, "TorchElasticEnvironment") == TWO_NODES
    weights = [trained(resumed, rank) for rank in (0, 1)]
    sampled = [lengths(first, rank) + lengths(resumed, rank) for rank in (0, 1)]  # iterations 1 and 2
    assert [len(iterations) for iterations in sampled] == [ITERATIONS] * 2
    assert_trains_as_one_node(weights, sampled, one_node("fsdp2"), tiny_digits)
    # The lock released, no temporary or set-aside folder left, and the checkpoint holds the shards
    # of both nodes' ranks (save_top_k 1 kept the newest iteration).
    folder = root / "checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["iteration=2.ckpt", "last.ckpt"]
    shards = sorted(path.name for path in (folder / "last.ckpt").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
