"""Train the selfcheck task as a user trains: a config file and ``lightning-ppo fit`` on it, in-process.

The selfcheck writes its config to ``OUT/selfcheck.yaml`` (``lightning-ppo fit --config`` runs it
again as it is) and passes the user's ``--trainer.*`` and ``--model.*`` options after it, so the
Trainer, strategy, precision, engine and estimator are the user's own, parsed and checked by the same
LightningCLI. ``fit`` is the CLI's in-process entry point (``lightning_ppo.cli.fit_in_process``, or
the command's own dispatch), handed in by the caller.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_ppo.runs.errors import UsageError
from lightning_ppo.selfcheck.task import SelfcheckTask

# Options that would make the run another problem than the one whose optimum is computed: the
# selfcheck's own flags set them.
_OWNED = {
    "--model.init_args.policy": "the selfcheck builds its own policy",
    "--model.init_args.reference": "the reference is the selfcheck's initial policy",
    "--model.init_args.reward_fn": "the reward is the task's",
    "--model.init_args.reward_model": "the reward is the task's",
    "--model.init_args.environment": "the environment is the task's (use --turns)",
    "--model.init_args.episode.max_turns": "the task's episodes have their own length (use --turns)",
    "--model.init_args.episode.max_tokens": "every episode of the task's length is listed",
    "--model.init_args.ppo.missing_eos_penalty": "the reward is the task's",
    "--model.init_args.ppo.kl_coef": "use --beta",
    "--model.init_args.ppo.kl_target": "the optimum is computed at a fixed beta",
    "--model.init_args.generation.max_new_tokens": "every response of the task's length is listed",
    "--data": "the prompts are the task's (use --batch-size)",
    "--trainer.max_steps": "use --iterations",
    "--trainer.max_epochs": "use --iterations",
    "--trainer.limit_train_batches": "use --iterations",
    "--trainer.logger": "the verdict reads the run's CSV log",
    "--trainer.callbacks": "the selfcheck's own decays the learning rate (append: --trainer.callbacks+=...)",
    "--model.init_args.lr_scheduler": "the selfcheck decays the learning rate itself",
    "--trainer.default_root_dir": "use --out",
    "--config": "the selfcheck writes its own (OUT/selfcheck.yaml)",
}
_PASSED = ("--trainer.", "--model.", "--seed_everything")


@dataclass
class RunSettings:
    """How long and how wide the selfcheck trains (its own flags), and the user's options for ``fit``.

    Attributes:
        out: The folder of the run: its policy, config, logs and plot.
        iterations: PPO iterations (rollout batches); ``None``: the task's (120 for one turn, 200 for two).
        batch_size: Prompts per batch on each rank (``data.batch_size``); even, so each batch holds as
            many of each prompt (or rater).
        lr: AdamW's learning rate (no weight decay: it would pull the weights, not the objective).
        overrides: ``--trainer.*`` / ``--model.*`` options passed to ``fit`` after the config.
    """

    out: Path
    iterations: int | None = None
    batch_size: int = 64
    lr: float = 3e-3
    task: SelfcheckTask = field(default_factory=SelfcheckTask)
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.iterations = self.iterations or self.task.iterations
        if self.iterations < 8:
            raise UsageError(f"selfcheck: --iterations must be >= 8, got {self.iterations}")
        kinds = self.task.rows_per_cycle
        if self.batch_size < 2 or self.batch_size % kinds:
            raise UsageError(
                f"selfcheck: --batch-size must be a multiple of the task's {kinds} kinds of row "
                f"(prompts x raters), got {self.batch_size}"
            )
        if not self.lr > 0:
            raise UsageError(f"selfcheck: --lr must be > 0, got {self.lr}")
        check_overrides(self.overrides)


def check_overrides(overrides: list[str]) -> None:
    """Options ``fit`` may take: ``--trainer.*``, ``--model.*``, ``--seed_everything``, but not those
    the selfcheck sets itself (each refused in one line saying which flag of its own to use)."""
    for arg in overrides:
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        for owned, why in _OWNED.items():
            if name == owned or name.startswith(owned + "."):
                raise UsageError(f"selfcheck: {name} cannot be set: {why}")
        if not name.startswith(_PASSED):
            raise UsageError(
                f"selfcheck: unknown option {name}: expected --trainer.*, --model.init_args.* or the "
                "selfcheck's own (see lightning-ppo selfcheck --help)"
            )


def config(settings: RunSettings, policy: Path) -> dict[str, Any]:
    """The run's config, as a user would write it."""
    task = settings.task
    return {
        "seed_everything": task.seed,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "limit_train_batches": settings.iterations,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "enable_model_summary": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "default_root_dir": str(settings.out),
            "logger": [{"class_path": "lightning_ppo.loggers.CSVLogger", "init_args": {"name": "csv"}}],
            "callbacks": callbacks(task),
        },
        "model": {
            "class_path": "lightning_ppo.PPOLightningModule",
            "init_args": {
                "policy": str(policy),
                **scoring(task),
                "ppo": {"kl_coef": task.beta, "missing_eos_penalty": None},
                "generation": {
                    "max_new_tokens": task.max_new_tokens,
                    "temperature": 1.0,
                    "suppress_tokens": task.suppressed(),
                },
                "optimizer": {
                    "class_path": "torch.optim.AdamW",
                    "init_args": {"lr": settings.lr, "weight_decay": 0.0},
                },
            },
        },
        "data": {
            "class_path": "lightning_ppo.selfcheck.task.SelfcheckPrompts",
            "init_args": {
                "task_prompts": list(task.prompts),
                "iterations": settings.iterations,
                **({"raters": list(task.raters)} if task.raters else {}),
                "batch_size": settings.batch_size,
                "max_prompt_length": 8,
            },
        },
    }


def callbacks(task: SelfcheckTask) -> list[dict[str, Any]]:
    """The learning rate's decay and, in one turn, the recorder of what sampled each batch (two turns'
    episodes are not checked: their likelihood needs the environment's turns listed too)."""
    decay = {"class_path": "lightning_ppo.selfcheck.schedule.IterationDecay"}
    if task.turns != 1:
        return [decay]
    recorder = {
        "class_path": "lightning_ppo.selfcheck.recorder.SamplingRecorder",
        "init_args": {"prompts": list(task.prompts)},
    }
    return [decay, recorder]


def scoring(task: SelfcheckTask) -> dict[str, Any]:
    """What scores the task: the reward of one turn, or the hint environment over two."""
    if task.turns == 1:
        reward = {"length": task.max_new_tokens, "offsets": dict(task.offsets)}
        if task.raters:
            reward.update(raters=dict(task.raters), noise=dict(task.noise))
        return {
            "reward_fn": {"class_path": "lightning_ppo.selfcheck.task.PromptCharReward", "init_args": reward}
        }
    return {
        "environment": {
            "class_path": "lightning_ppo.selfcheck.hint.HintEnvironment",
            "init_args": {"length": task.max_new_tokens},
        },
        "episode": {"max_turns": 2, "max_tokens": task.budget},
    }


@dataclass
class FitOutcome:
    """What the verdict needs of the run: its CSV log and the settings the module ran with."""

    metrics: Path
    module: Any  # the fitted PPOLightningModule (its ppo and generation settings as parsed)


def is_first_rank() -> bool:
    """Whether this process is rank 0 of the job (a launcher gives the others a ``RANK``/``LOCAL_RANK``):
    only it builds the task and judges the run; the others train beside it."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def run_fit(settings: RunSettings, fit: Callable[[list[str]], Any]) -> FitOutcome | None:
    """Build the task, write the config, fit it; ``None`` on a rank other than 0 (it only trains)."""
    first = is_first_rank()
    policy = settings.task.checkpoint(settings.out, builds=first)
    path = settings.out / "selfcheck.yaml"
    if first:
        text = yaml.safe_dump(config(settings, policy), sort_keys=False)
        staging = path.with_suffix(".yaml.tmp")
        staging.write_text(text)
        os.replace(staging, path)
    with warnings.catch_warnings():
        # Lightning's note that sys.argv (the selfcheck's own command line) is not what it parses: on
        # purpose, and its launcher starts each other rank with that command line, as it should.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        cli = fit(["fit", "--config", str(path), *settings.overrides])
    if cli is None or not cli.trainer.is_global_zero:
        return None
    return FitOutcome(Path(cli.trainer.logger.log_dir) / "metrics.csv", cli.model)
