"""Synchronous PPO against one step off (``ppo.max_staleness: 1``), on 2 CPU cores.

    .venv-vllm/bin/python -m benchmarks.async_rollouts                # the table (server rows need vllm)
    .venv/bin/python -m benchmarks.async_rollouts --engines hf        # without vllm
    .venv-vllm/bin/python -m benchmarks.async_rollouts --iterations 3 --rounds 1   # a smoke run
    .venv/bin/python -m benchmarks.async_rollouts --learning          # quickstart score per wall second

The same PPO run (a 4 x 256 GPT-2 on the quickstart's task, batch 64, GAE, fp32), sized so that
generating a batch and training on it take about as long (96 new tokens, 1 epoch x 2
minibatches), each variant in a process of its own, alternated round by round:

- ``hf``: the trainer's process on both cores, one thread each for its main and background thread
  (synchronous: the main thread generates, the second core idles);
- ``vllm_server``: the trainer on core 0 (one thread), one ``lightning-ppo serve`` server on core 1.

Seconds per trained iteration (median; the first iterations, warm-up and the ones that only start
sampling, left out). One step off can at best take max(G, S + T) where synchronous takes G + S + T
(G generating, S scoring and the rollout forwards, T the update): the table prints G and S + T of
the synchronous run beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import pinned_child, timed_digits_fit
from benchmarks.flags import at_least_one

ROOT = Path(__file__).resolve().parents[1]
BATCH = 64
NEW_TOKENS = 96


def torch_threads_one() -> None:
    import torch

    torch.set_num_threads(1)


def child(policy: str, engine: str, url: str | None, staleness: int, iterations: int) -> dict:
    """Per-iteration seconds of a run, and (synchronous) the share spent generating."""
    import torch

    from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
    from lightning_ppo.tasks.digits import DigitsReward

    torch.set_num_threads(1)
    servers = {"server_urls": [url]} if url else {}
    module = PPOLightningModule(
        policy=policy,
        reward_fn=DigitsReward(),
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=2, max_staleness=staleness),
        generation=GenerationConfig(max_new_tokens=NEW_TOKENS, engine=engine, **servers),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5),
    )
    generating: list[float] = []
    original = module.generate

    def timed_generate(batch):
        start = time.perf_counter()
        out = original(batch)
        generating.append(time.perf_counter() - start)
        return out

    module.generate = timed_generate

    steps = timed_digits_fit(module, iterations + 2 + staleness, BATCH)
    counted = steps[2 + staleness :]
    return {"steps": counted, "generate": generating[2:] if generating else []}


def learning(seeds: list[int], iterations: int) -> None:
    """The quickstart (GAE, kl_coef 0.02, ``hf``), synchronous and one step off, seed by seed: the
    score of the last 10 % of iterations against wall seconds (one torch thread per thread)."""
    from lightning_ppo.callbacks import TrainingSummary
    from lightning_ppo.cli import main as cli
    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-async-learning-"))
    policy = make_tiny_checkpoint(work / "digits", TinyModelSpec(), alphabet="0123456789=")
    print("| seed | max_staleness | iterations | last score | final KL | wall s | score gained / wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seed in seeds:
        for staleness in (0, 1):
            run = cli(
                [
                    *("fit", "--config", str(ROOT / "configs" / "quickstart.yaml")),
                    *("--model.init_args.policy", str(policy), "--seed_everything", str(seed)),
                    *(
                        "--model.init_args.ppo.kl_coef",
                        "0.02",
                        "--model.init_args.ppo.max_staleness",
                        str(staleness),
                    ),
                    *("--trainer.limit_train_batches", str(iterations + staleness)),
                    *(
                        "--trainer.default_root_dir",
                        str(work / f"{seed}-{staleness}"),
                        "--trainer.logger",
                        "false",
                    ),
                    *("--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false"),
                    *("--trainer.limit_val_batches", "0"),
                    *("--trainer.callbacks", '[{"class_path": "lightning_ppo.callbacks.TrainingSummary"}]'),
                ]
            )
            summary = next(cb for cb in run.trainer.callbacks if isinstance(cb, TrainingSummary)).summary
            gained = (summary.last_score - summary.first_score) / summary.wall_seconds
            print(
                f"| {seed} | {staleness} | {summary.iterations} | {summary.last_score:.3f} | "
                f"{summary.final_kl:.2f} | {summary.wall_seconds:.1f} | {gained:.4f} |",
                flush=True,
            )


def _run(args: list[str], cores: str, threads: int) -> dict:
    env = {"OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return pinned_child("benchmarks.async_rollouts", args, cores, env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=at_least_one, default=8)
    parser.add_argument("--rounds", type=at_least_one, default=2)
    parser.add_argument("--engines", default="hf,vllm_server")
    parser.add_argument("--child", nargs="*")
    parser.add_argument("--learning", action="store_true", help="the quickstart's score per wall second")
    args = parser.parse_args()
    if args.learning:
        torch_threads_one()
        learning([0, 1, 2], 60)
        return
    if args.child:
        policy, engine, url, staleness, iterations = args.child
        print(json.dumps(child(policy, engine, None if url == "-" else url, int(staleness), int(iterations))))
        return
    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    policy = make_tiny_checkpoint(
        work / "policy",
        TinyModelSpec(n_layer=4, n_embd=256, n_head=4, n_positions=128),
        alphabet="0123456789=",
    )
    engines = args.engines.split(",")
    server = None
    if "vllm_server" in engines:
        from lightning_ppo.rollout.engines.server.local_server import LocalServer

        env = {"VLLM_CPU_OMP_THREADS_BIND": "1"}
        server = LocalServer(policy, work / "server.log", dtype="float32", env=env, cpus={1}).wait_ready()
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        for _ in range(args.rounds):
            for engine in engines:
                for staleness in (0, 1):
                    url = server.url if engine == "vllm_server" else "-"
                    cores, threads = ("0", 1) if engine == "vllm_server" else ("0,1", 1)
                    child_args = [str(policy), engine, url, str(staleness), str(args.iterations)]
                    results.setdefault((engine, staleness), []).append(_run(child_args, cores, threads))
    finally:
        if server is not None:
            server.stop()
    shape = f"batch {BATCH} x {NEW_TOKENS} new tokens, {args.rounds} rounds x {args.iterations} iterations"
    print(f"\n4 x 256 GPT-2, {shape}")
    print("| engine | max_staleness | s / iteration (median) | vs synchronous | G (sync) | S + T (sync) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for engine in engines:
        sync = [s for r in results[(engine, 0)] for s in r["steps"]]
        generate = statistics.median([g for r in results[(engine, 0)] for g in r["generate"]])
        base = statistics.median(sync)
        for staleness in (0, 1):
            steps = [s for r in results[(engine, staleness)] for s in r["steps"]]
            median = statistics.median(steps)
            print(
                f"| {engine} | {staleness} | {median:.3f} | {median / base:.2f}x | {generate:.3f} | "
                f"{base - generate:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
