"""How often ``ppo.torch_compile`` compiles the loss pass over a quickstart run with variable lengths.

    .venv/bin/python -m benchmarks.compile_count                            # 20 iterations, counted
    .venv/bin/python -m benchmarks.compile_count --backend inductor --time  # + eager vs compiled s / it

The quickstart (configs/quickstart.yaml's ppo, generation, optimizer and data settings, the
tiny-digits checkpoint built in a temporary folder) with ``ppo.torch_compile``, in three settings:

* ``quickstart``: as configured. A fresh policy's responses stop anywhere in 1-8 tokens, so row
  groups and trimming give the loss micro-batches of many shapes (rows x columns), some of one row;
* ``kl_target, kl in loss``: ``kl_target: 1``, ``kl_placement: loss`` (``k3``): the coefficient the
  loss reads changes every iteration;
* ``LoRA + checkpointing``: a 2 x 64 Llama over the same vocabulary, ``lora`` and
  ``gradient_checkpointing``.

For each: the graphs torch.compile built (each a compilation: a new guard set or a piece after a
graph break), the frames it compiled, graph breaks, whether the recompile limit was hit, and the
distinct micro-batch shapes and KL coefficients the loss saw. ``--backend eager`` (the default)
builds dynamo's graphs without generating code: it specialises and recompiles exactly as inductor
does, in seconds. ``--time`` also runs each setting eager and gives the median seconds per iteration
after the first (the compiled run's first iteration, which compiles, apart; inductor's caches off so
that it compiles in every run), one torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
import yaml
from lightning.pytorch import Callback, Trainer, seed_everything
from torch._dynamo.utils import counters

import lightning_ppo.ppo.compiled_loss as compiled_loss
from benchmarks.flags import at_least_one
from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Setting:
    """A run's settings over the quickstart's."""

    ppo: dict[str, Any] = field(default_factory=dict)
    arch: str = "gpt2"
    lora: bool = False
    gradient_checkpointing: bool = False


KL_IN_LOSS = {"kl_target": 1.0, "kl_placement": "loss", "kl_estimator": "k3"}
SETTINGS = {
    "quickstart": Setting(),
    "kl_target, kl in loss": Setting(ppo=KL_IN_LOSS),
    "LoRA + checkpointing": Setting(arch="llama", lora=True, gradient_checkpointing=True),
}


@dataclass
class CompileCount:
    """Counts what torch.compile does to ``ppo.torch_compile``'s loss pass while active (it resets
    dynamo on entry): ``graphs`` (compilations), ``frames``, ``breaks``, ``limit_hit``, and the
    micro-batch ``shapes`` the loss saw (rows, sequence columns, response columns)."""

    backend: str = "eager"
    graphs: int = 0
    frames: int = 0
    breaks: int = 0
    limit_hit: bool = False
    shapes: Counter = field(default_factory=Counter)

    def __enter__(self) -> CompileCount:
        torch._dynamo.reset()
        counters.clear()
        self._saved = compiled_loss.BACKEND, compiled_loss.for_compiled
        compiled_loss.BACKEND, compiled_loss.for_compiled = self._counted_backend, self._seen
        return self

    def __exit__(self, *exc: Any) -> None:
        compiled_loss.BACKEND, compiled_loss.for_compiled = self._saved
        self.frames = counters["frames"]["ok"]
        self.breaks = sum(counters["graph_break"].values())
        limits = ("recompile limit", "recompile_limit", "cache_size_limit", "cache size limit")
        self.limit_hit = any(word in key.lower() for key in counters["unimplemented"] for word in limits)

    def _counted_backend(self, graph: torch.fx.GraphModule, inputs: list) -> Any:
        self.graphs += 1
        return torch._dynamo.lookup_backend(self.backend)(graph, inputs)

    def _seen(self, mb: Any) -> Any:
        rows, columns = mb.input_ids.shape
        self.shapes[(rows, columns, mb.response_ids.shape[1])] += 1
        return self._saved[1](mb)


class IterationLog(Callback):
    """Seconds of every iteration, and the KL coefficient each one's loss read."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.kl_coefs: list[float] = []

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()
        self.kl_coefs.append(module.kl_ctl.value)

    def on_train_batch_end(self, trainer: Trainer, module: Any, *args: Any) -> None:
        self.seconds.append(time.perf_counter() - self._start)


def quickstart_settings() -> dict[str, Any]:
    """configs/quickstart.yaml's model and data arguments."""
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    return {"model": config["model"]["init_args"], "data": config["data"]["init_args"]}


def run(
    checkpoint: Path, iterations: int, compiled: bool, setting: Setting = Setting(), root: Path | None = None
) -> IterationLog:
    """``iterations`` quickstart iterations on ``checkpoint``: the log of their seconds and coefficients."""
    quickstart = quickstart_settings()
    model, data = quickstart["model"], dict(quickstart["data"])
    lr = model["optimizer"]["init_args"]["lr"]
    seed_everything(0, verbose=False)
    module = PPOLightningModule(
        policy=str(checkpoint),
        reward_fn=DigitsReward(),
        ppo=PPOConfig(**{**model["ppo"], **setting.ppo, "torch_compile": compiled}),
        generation=GenerationConfig(**model["generation"]),
        lora=LoraSettings() if setting.lora else None,
        gradient_checkpointing=setting.gradient_checkpointing,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
    )
    data.update(num_prompts=iterations * data["batch_size"], num_val_prompts=0)
    log = IterationLog()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=iterations,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root or tempfile.mkdtemp(),
        callbacks=[log],
    )
    trainer.fit(module, datamodule=DigitsDataModule(**data))
    return log


def checkpoints(folder: Path) -> dict[str, Path]:
    """The quickstart's tiny-digits GPT-2 and a Llama of its size, built from configs."""
    alphabet = "0123456789="
    return {
        "gpt2": make_tiny_checkpoint(folder / "tiny-digits", TinyModelSpec(), alphabet=alphabet),
        "llama": make_tiny_checkpoint(folder / "tiny-llama", TinyModelSpec(arch="llama"), alphabet=alphabet),
    }


def median_after_first(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] or seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--iterations", type=at_least_one, default=20)
    parser.add_argument("--backend", default="eager", help="eager (default), aot_eager, inductor")
    parser.add_argument("--time", action="store_true", help="also time eager and compiled runs")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch._inductor.config.force_disable_caches = args.time
    counted = ["setting", "graphs", "frames", "graph breaks", "recompile limit hit", "shapes", "KL coefs"]
    timed = ["setting", "eager s / it", "compiled s / it", "compiled first it s", "compiled run s"]
    counts, timings = [counted], [timed]
    with tempfile.TemporaryDirectory() as folder:
        paths, root = checkpoints(Path(folder)), Path(folder) / "run"
        for name in args.settings:
            setting = SETTINGS[name]
            with CompileCount(args.backend) as count:
                start = time.perf_counter()
                log = run(paths[setting.arch], args.iterations, True, setting, root)
                total = time.perf_counter() - start
            kl_coefs = len(set(log.kl_coefs))
            limit = "yes" if count.limit_hit else "no"
            counts.append(
                [name, count.graphs, count.frames, count.breaks, limit, len(count.shapes), kl_coefs]
            )
            if args.time:
                eager = run(paths[setting.arch], args.iterations, False, setting, root)
                seconds = median_after_first(eager.seconds), median_after_first(log.seconds)
                timings.append(
                    [name, *(f"{s:.3f}" for s in seconds), f"{log.seconds[0]:.1f}", f"{total:.1f}"]
                )
    print(f"{args.iterations} iterations, backend {args.backend}, torch {torch.__version__}\n")
    print(table(counts))
    if args.time:
        print("\n" + table(timings))
    return 0


def table(rows: list[list[Any]]) -> str:
    """A markdown table, the first row its header."""
    lines = ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join([lines[0], "| " + " | ".join(["---"] * len(rows[0])) + " |", *lines[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
