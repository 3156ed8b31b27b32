"""Per-rank memory and time of a GPT-2-small-sized PPO run: one process, DDP and FSDP2 on 2 CPU ranks.

    .venv/bin/python -m benchmarks.sharded_memory            # 12 x 768, vocab 50257 (GPT-2 small)
    .venv/bin/python -m benchmarks.sharded_memory --small    # 2 x 64, a smoke test

Each setting runs in its own processes through the real Trainer and CLI-free Python API: the
separate layout (policy, reference copy, critic with its own backbone, reward model), AdamW.
Reported per rank, from the tensors each rank actually holds (a DTensor counts its local shard):
parameters (trained + frozen), gradients (one per trained parameter, alive during the backward
pass), AdamW state, their sum, the process's peak RSS and its RSS after training; and the seconds
per PPO iteration after a warm-up iteration (medians over the timed iterations, the slower rank).
Every setting builds the roles empty and reads them in ``configure_model`` (lightning_ppo.models.placement):
under FSDP2 each rank reads only its shards of the checkpoints. FSDP2's policy stays gathered
through each generation (the setting "gather_for_generation false": not). ``--settings`` picks the
rows (default: one process, DDP, FSDP2). Threads:
``OMP_NUM_THREADS`` = CPU cores / ranks in every setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common
from benchmarks.flags import at_least
from benchmarks.roles_memory import write_checkpoints

SETTINGS = {
    "1 process": (1, "auto"),
    "DDP, 2 ranks": (2, "ddp"),
    "FSDP2, 2 ranks": (2, "fsdp2"),
    "FSDP2, 2 ranks, gather_for_generation false": (2, "fsdp2-nogather"),
}
MB = 2**20


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _current_rss_mib() -> float:
    """This process's resident memory now (Linux), after training: the steady state, not the peak."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def measure(devices: int, strategy: str, policy: str, reward: str, iterations: int, out: str) -> None:
    """Run ``iterations`` PPO iterations and write this rank's figures to ``out/rank<k>.json``."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule, PromptDataModule

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_train_start(self, *args) -> None:
            self.loaded_peak = common.peak_rss_mib()  # the models loaded (and sharded), nothing run yet

        def on_train_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.seconds.append(time.perf_counter() - self.start)

    pl.seed_everything(0)
    gather = strategy != "fsdp2-nogather"
    module = PPOLightningModule(
        policy=policy,
        reward_model=reward,
        value=policy,
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=8, gather_for_generation=gather),
    )
    if strategy.startswith("fsdp2"):
        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    timer = Timer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=iterations,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    data = PromptDataModule(prompts=["12345="] * (4 * devices * iterations), batch_size=4, shuffle=False)
    trainer.fit(module, datamodule=data)
    unique = {id(p): p for p in module.parameters()}.values()
    params = sum(_local_bytes(p) for p in unique)
    grads = sum(_local_bytes(p) for p in unique if p.requires_grad)
    state = trainer.optimizers[0].state.values()
    optimizer = sum(_local_bytes(t) for s in state for t in s.values() if torch.is_tensor(t) and t.dim())
    timed = sorted(timer.seconds[1:])
    row = {
        "rank": trainer.global_rank,
        "params_mb": params / MB,
        "grads_mb": grads / MB,
        "optimizer_mb": optimizer / MB,
        "loaded_peak_rss_mb": timer.loaded_peak,
        "peak_rss_mb": common.peak_rss_mib(),
        "end_rss_mb": _current_rss_mib(),
        "s_per_iteration": timed[len(timed) // 2],
    }
    (Path(out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(row))


def run_setting(devices: int, strategy: str, policy: Path, reward: Path, iterations: int) -> dict:
    """Every rank's figures for one setting; the row reported is the largest per rank."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "benchmarks.sharded_memory", "--child", str(devices), strategy]
        cmd += [str(policy), str(reward), str(iterations), out]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // devices))}
        subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        ranks = [json.loads((Path(out) / f"rank{rank}.json").read_text()) for rank in range(devices)]
    return {key: max(r[key] for r in ranks) for key in ranks[0] if key != "rank"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 2 x 64 model instead of GPT-2 small")
    parser.add_argument(
        "--iterations", type=at_least(2), default=4, help="PPO iterations (the first is warm-up)"
    )
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS)[:3])
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        devices, strategy, policy, reward, iterations, out = ns.child
        measure(int(devices), strategy, policy, reward, int(iterations), out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        policy, reward = write_checkpoints(Path(tmp), ns.small)
        rows = {name: run_setting(*SETTINGS[name], policy, reward, ns.iterations) for name in ns.settings}
    print(f"{os.cpu_count()} CPU cores, {ns.iterations} iterations per setting (the first is warm-up)")
    print(
        "| setting | parameters (MB/rank) | gradients (MB/rank) | AdamW state (MB/rank) | sum (MB/rank) "
        "| peak RSS by the end of loading (MB/rank) | peak RSS (MB/rank) | RSS after training (MB/rank) "
        "| s / iteration |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        total = row["params_mb"] + row["grads_mb"] + row["optimizer_mb"]
        print(
            f"| {name} | {row['params_mb']:.0f} | {row['grads_mb']:.0f} | {row['optimizer_mb']:.0f} "
            f"| {total:.0f} | {row['loaded_peak_rss_mb']:.0f} | {row['peak_rss_mb']:.0f} "
            f"| {row['end_rss_mb']:.0f} | {row['s_per_iteration']:.2f} |"
        )


if __name__ == "__main__":
    main()
