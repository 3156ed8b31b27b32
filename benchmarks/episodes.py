"""Multi-turn cost: a 3-turn episode against one reply of about the same number of tokens.

    .venv/bin/python -m benchmarks.episodes                  # 3 rounds of 20 iterations per variant
    .venv/bin/python -m benchmarks.episodes --rounds 1 --iterations 4   # a smoke run

The quickstart's tiny GPT-2 (``checkpoints/tiny-digits``), batch 64, ``hf`` engine. ``one turn``
samples up to 22 tokens; ``three turns`` samples up to 6 tokens per turn with a 2-token observation
between turns (3 x 6 + 2 x 2 = 22 tokens after the prompt at most). Variants alternate, round by
round, each run in a process of its own. Responses stop where the policy samples its stop token,
so the tokens each variant computes differ: the table reports them, and the seconds per 1,000 tokens after the
prompt, which is what "multi-turn costs no more than the tokens it adds" compares. Each turn
re-reads the whole context (no KV cache across turns), which the last column prices.

    .venv/bin/python -m benchmarks.episodes --slow         # environments that take 50 / 500 ms a step

``--slow``: one rollout of 64 episodes x 3 turns against an environment whose every ``step`` waits
50 or 500 ms (a sandbox, a web tool), its calls one by one (``episode.max_concurrency: 1``), on
threads (``max_concurrency: 64``), and as ``async def``: seconds per rollout, and the waiting a
rollout cannot avoid (3 turns x one step) beside it.

    .venv/bin/python -m benchmarks.episodes --prefill      # what re-reading the context costs

``--prefill``: 16 episodes x 4 turns of a 4 x 256 Llama (a 32-token observation between turns) with
``hf``: each turn's ``generate`` beside one forward over the same contexts, which is what that
generate spends re-reading the episode so far (its prefill), the most a KV cache kept across
turns could save (it would still read the observation's tokens); then the whole rollout with and
without ``episode.keep_cache``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from benchmarks.flags import at_least_one
from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.config import EpisodeConfig
from lightning_ppo.rollout.episodes import Environment, StepResult, Turn
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward

ROOT = Path(__file__).resolve().parents[1]


class Nudge(Environment):
    """Answers every turn with the same 2-token observation; the episode ends after 3 turns."""

    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation="0=")


class Done(Environment):
    """Done after the first reply: the single-turn path bit for bit (tests/test_episodes.py), with
    the runner's exact token count."""

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


class Waits(Environment):
    """Every step takes ``seconds`` (a sandbox, an HTTP tool), then answers as :class:`Nudge`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def step(self, turn: Turn) -> StepResult:
        time.sleep(self.seconds)
        return StepResult(observation="0=")


class AsyncWaits(Waits):
    async def step(self, turn: Turn) -> StepResult:
        await asyncio.sleep(self.seconds)
        return StepResult(observation="0=")


def slow_table(policy: str) -> None:
    """Seconds per rollout (64 episodes x 3 turns) against environments that wait 50 / 500 ms a step."""
    data = DigitsDataModule(num_prompts=64, batch_size=64, max_prompt_length=16)
    print("| step takes | calls | s / rollout | of which unavoidable waiting |")
    print("| --- | --- | --- | --- |")
    for seconds in (0.05, 0.5):
        for name, environment, concurrency in (
            ("one by one", Waits(seconds), 1),
            ("threads (64)", Waits(seconds), 64),
            ("async def", AsyncWaits(seconds), 64),
        ):
            module = PPOLightningModule(
                policy=policy,
                reward_fn=DigitsReward(),
                environment=environment,
                episode=EpisodeConfig(max_turns=3, max_tokens=22, max_concurrency=concurrency),
                generation=GenerationConfig(max_new_tokens=6),
            )
            data.set_tokenizer(module.tokenizer)
            data.setup("fit")
            batch = next(iter(data.train_dataloader()))
            torch.manual_seed(0)
            start = time.perf_counter()
            module.generate(batch)
            took = time.perf_counter() - start
            print(f"| {1000 * seconds:.0f} ms | {name} | {took:.2f} | {3 * seconds:.2f} |", flush=True)


class LongNudge(Environment):
    """Answers every turn with a 32-token observation."""

    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation="0123456789" * 3 + "0=")


def prefill_table() -> None:
    """Per turn: the engine's generate, and one forward over its contexts (the re-read)."""
    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    policy = ROOT / "checkpoints" / "tiny-llama-256"
    if not (policy / "config.json").exists():
        spec = TinyModelSpec(arch="llama", n_layer=4, n_embd=256, n_head=4, n_positions=1024)
        make_tiny_checkpoint(policy, spec, alphabet="0123456789=")
    module = PPOLightningModule(
        policy=str(policy),
        reward_fn=DigitsReward(),
        environment=LongNudge(),
        episode=EpisodeConfig(max_turns=4, max_tokens=512),
        generation=GenerationConfig(max_new_tokens=32),
    )
    data = DigitsDataModule(num_prompts=16, batch_size=16, max_prompt_length=16)
    data.set_tokenizer(module.tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    engine, rows = module.engine, []
    generate = engine.generate

    def timed(ids, mask):
        start = time.perf_counter()
        rollout = generate(ids, mask)
        took = time.perf_counter() - start
        with torch.no_grad():
            start = time.perf_counter()
            module.policy(input_ids=ids, attention_mask=mask.long())
            rows.append((ids.shape[1], took, time.perf_counter() - start, int(rollout.response_mask.sum())))
        return rollout

    engine.generate = timed
    torch.manual_seed(0)
    module.generate(batch)  # warm-up
    rows.clear()
    module.generate(batch)
    print(
        "| turn | context width | generate s | of which re-reading the context (one forward) s | new tokens |"
    )
    print("| --- | --- | --- | --- | --- |")
    for turn, (width, took, prefill, tokens) in enumerate(rows):
        print(f"| {turn} | {width} | {took:.3f} | {prefill:.3f} | {tokens} |")
    later = rows[1:]
    share = sum(p for _, _, p, _ in later) / sum(t for _, t, _, _ in rows)
    print(f"re-reading after the first turn: {100 * share:.1f} % of the rollout's generate time")
    engine.generate = generate
    print("| episode.keep_cache | s / rollout (median of 3) | tokens after the prompt |")
    print("| --- | --- | --- |")
    for keep in (False, True):
        module.episode_runner.config = EpisodeConfig(max_turns=4, max_tokens=512, keep_cache=keep)
        times = []
        for _ in range(3):
            torch.manual_seed(0)
            start = time.perf_counter()
            module.generate(batch)
            times.append(time.perf_counter() - start)
        tokens = int(module.episode_runner.last_stats.tokens.sum())
        print(f"| {str(keep).lower()} | {statistics.median(times):.3f} | {tokens} |", flush=True)


class Clock(pl.Callback):
    """Seconds and tokens after the prompt of every iteration."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.tokens: list[int] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._start)
        self.tokens.append(int(pl_module.episode_runner.last_stats.tokens.sum()))


def run(policy: str, turns: int, iterations: int, seed: int, engine: str = "hf") -> Clock:
    pl.seed_everything(seed)
    module = PPOLightningModule(
        policy=policy,
        reward_fn=DigitsReward(),
        environment=Nudge() if turns > 1 else Done(),
        episode=EpisodeConfig(max_turns=3, max_tokens=22),
        ppo=PPOConfig(kl_coef=0.05),
        generation=GenerationConfig(
            max_new_tokens=6 if turns > 1 else 22, engine=engine, gpu_memory_utilization=0.1
        ),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    data = DigitsDataModule(num_prompts=64 * (iterations + 1), batch_size=64, max_prompt_length=16, seed=seed)
    clock = Clock()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=iterations,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(module, datamodule=data)
    return clock


def _policy(engine: str) -> str:
    """The quickstart's checkpoint for ``hf``; for ``vllm``, whose CPU attention has no kernel for its
    head size of 16, the same vocabulary at 2 x 128 with 2 heads (head size 64), built once."""
    if engine == "hf":
        return str(ROOT / "checkpoints" / "tiny-digits")
    from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

    out = ROOT / "checkpoints" / "tiny-digits-h64"
    if not (out / "config.json").exists():
        make_tiny_checkpoint(out, TinyModelSpec(n_embd=128, n_head=2), alphabet="0123456789=")
    return str(out)


def run_apart(policy: str, turns: int, iterations: int, seed: int, engine: str) -> tuple[list, list]:
    """One variant in a process of its own (vLLM keeps process-wide state: one engine per process)."""
    cmd = [sys.executable, "-m", "benchmarks.episodes", "--one", str(turns), "--seed", str(seed)]
    cmd += ["--iterations", str(iterations), "--policy", policy, "--engine", engine]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{turns} turns failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["seconds"], result["tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least_one, default=3)
    parser.add_argument("--iterations", type=at_least_one, default=20)
    parser.add_argument("--policy", default=None, help="default: the quickstart's tiny GPT-2 (hf)")
    parser.add_argument(
        "--engine",
        default="hf",
        choices=["hf", "vllm"],
        help="vllm: run with the vLLM environment's interpreter (.venv-vllm, `make test-vllm` builds it)",
    )
    parser.add_argument("--slow", action="store_true", help="environments that wait 50 / 500 ms a step")
    parser.add_argument("--prefill", action="store_true", help="what re-reading the context costs (hf)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: one variant
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    ns.policy = ns.policy or _policy(ns.engine)
    if ns.slow:
        slow_table(ns.policy)
        return
    if ns.prefill:
        prefill_table()
        return
    if ns.one is not None:
        clock = run(ns.policy, ns.one, ns.iterations, ns.seed, ns.engine)
        print(json.dumps({"seconds": clock.seconds, "tokens": clock.tokens}))
        return
    results: dict[str, tuple[list, list]] = {"one turn": ([], []), "three turns": ([], [])}
    for round_ in range(ns.rounds):
        for name, turns in (("one turn", 1), ("three turns", 3)):
            seconds, tokens = run_apart(ns.policy, turns, ns.iterations, round_, ns.engine)
            results[name][0].extend(seconds[1:])  # the first iteration warms up
            results[name][1].extend(tokens[1:])
    threads = torch.get_num_threads()
    print(f"{ns.rounds} rounds x {ns.iterations} iterations, batch 64, {threads} threads, engine {ns.engine}")
    print("| variant | s / iteration (median) | tokens after the prompt / iteration | s / 1,000 tokens |")
    print("| --- | --- | --- | --- |")
    for name, (seconds, tokens) in results.items():
        per_k = 1000 * sum(seconds) / sum(tokens)
        print(f"| {name} | {statistics.median(seconds):.3f} | {statistics.mean(tokens):.0f} | {per_k:.3f} |")


if __name__ == "__main__":
    main()
