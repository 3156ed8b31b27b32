"""One weight sync of a 0.5B policy into a vLLM server on GPUs: vLLM's NCCL transfer against ours.

    python -m benchmarks.sync_transports --out runs/sync-transports     # make gpu-check's `sync` stage

The policy is a random-weight model of Qwen2.5-0.5B's shape (``benchmarks.common``'s
``qwen2.5-0.5b``: 0.49B parameters, 0.99 GB in bfloat16) on the trainer's GPU (the first visible
one); one ``lightning-ppo serve`` server (``LocalServer``, bfloat16, ``--enforce-eager``) per
transport on the second GPU where there are two, else on the same one:

- ``memory`` (``generation.sync_transport: memory``, ours): each weight copied to the host, broadcast
  over gloo (TCP), copied to the server's GPU;
- ``nccl`` (vLLM 0.32's weight transfer, ``serve --nccl``): GPU to GPU over NCCL. It needs two
  GPUs (NCCL refuses two ranks of one group on one device): with one, its row says so.

Each transport's first sync (the group joined, the weights checked against the server's checksums)
is timed apart; then ``--repeats`` syncs, unchecked as a run's are, their median reported. It
needs CUDA and vLLM with CUDA in this interpreter; where either is missing it says so in one line
and exits 0. ``--json FILE`` writes the rows (``make gpu-check`` reads them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.flags import at_least_one

PRESET = "qwen2.5-0.5b"


@dataclass
class Row:
    transport: str
    status: str  # "ok", "skipped" or "FAILED"
    first_s: float | None = None  # the first sync: the group joined, the weights checked
    sync_s: float | None = None  # the median of the syncs after it
    syncs: int = 0
    gib: float = 0.0  # the weights sent per sync
    note: str = ""


def missing() -> str | None:
    """Why this machine cannot run the benchmark (one line), ``None`` where it can."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA"
    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM (with CUDA) in this interpreter"
    return None


def policy_folder(out: Path) -> Path:
    """The random-weight policy of :data:`PRESET`, written once into ``out``."""
    from transformers import AutoModelForCausalLM

    from benchmarks.common import PRESETS, build_tokenizer, model_config

    folder = out / "checkpoints" / PRESET / "policy"
    if not (folder / "config.json").exists():
        tokenizer = build_tokenizer(PRESETS[PRESET])
        AutoModelForCausalLM.from_config(model_config(PRESETS[PRESET], tokenizer)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def measure(transport: str, policy: Path, out: Path, repeats: int, server_device: int) -> Row:
    """One server for ``transport``: its first sync, then ``repeats`` syncs of the moved policy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_ppo import GenerationConfig
    from lightning_ppo.rollout.engines import Placement
    from lightning_ppo.rollout.engines.server import VLLMServerEngine
    from lightning_ppo.rollout.engines.server.local_server import LocalServer
    from lightning_ppo.rollout.sampling import hf_generation_config

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    device = visible[server_device] if visible != [""] else str(server_device)
    vllm_args = ("--enforce-eager", "--gpu-memory-utilization", "0.3", "--max-model-len", "512")
    serve_args = ("--nccl",) if transport == "nccl" else ()
    log = out / f"sync-server-{transport}.log"
    env = {"CUDA_VISIBLE_DEVICES": device}
    with LocalServer(
        policy, log, "bfloat16", vllm_args, env, start_timeout=600, serve_args=serve_args
    ) as server:
        tokenizer = AutoTokenizer.from_pretrained(policy)
        config = GenerationConfig(
            max_new_tokens=8,
            engine="vllm_server",
            server_urls=[server.url],
            sync_transport=transport,
            server_timeout=300,
        )
        hf = hf_generation_config(config, None, tokenizer.pad_token_id)
        engine = VLLMServerEngine(config, hf, Placement(), tokenizer, len(tokenizer))
        model = AutoModelForCausalLM.from_pretrained(policy, torch_dtype=torch.bfloat16).cuda()
        gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        try:
            seconds = []
            for _ in range(1 + repeats):
                with torch.no_grad():  # a policy that moved since the last sync, as in training
                    next(model.parameters()).add_(1e-3)
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.sync_weights(model)
                seconds.append(time.perf_counter() - start)
        finally:
            engine.close()
    return Row(transport, "ok", seconds[0], statistics.median(seconds[1:]), repeats, gib)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sync_transports", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", default="runs/sync-transports", help="folder for the checkpoint and logs")
    p.add_argument("--repeats", type=at_least_one, default=5, help="syncs timed after the first")
    p.add_argument("--transports", default="memory,nccl")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    why = missing()
    if why is not None:
        print(f"sync transports: skipped: {why}")
        return 0
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy = policy_folder(out)
    gpus = torch.cuda.device_count()
    rows = []
    for transport in args.transports.split(","):
        if transport == "nccl" and gpus < 2:
            rows.append(
                Row(transport, "skipped", note=f"needs 2 GPUs (NCCL: one rank per device), {gpus} here")
            )
            continue
        try:
            rows.append(measure(transport, policy, out, args.repeats, server_device=min(1, gpus - 1)))
        except Exception as err:  # the other transport's row still comes
            rows.append(
                Row(transport, "FAILED", note=f"{type(err).__name__}: {' '.join(str(err).split())[:200]}")
            )
        print(json.dumps(asdict(rows[-1])), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return 1 if any(row.status == "FAILED" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
