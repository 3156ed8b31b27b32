"""The ``lightning-ppo`` command: LightningCLI for ``fit``, plus ``make-tiny`` for offline checkpoints.

``main(args)`` runs in-process, so tests drive the real CLI without a subprocess.
"""

from __future__ import annotations

import argparse
import os
import sys
from argparse import ArgumentError
from pathlib import Path
from typing import Any

import datasets
import transformers
from jsonargparse import Namespace
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lightning_ppo.checkpoint import PPOCheckpoint, nothing_to_resume
from lightning_ppo.config import GenerationConfig, PPOConfig
from lightning_ppo.data import PromptDataModule
from lightning_ppo.distributed.sharding import reject_fsdp1
from lightning_ppo.export import export_main
from lightning_ppo.models.roles import LoraSettings
from lightning_ppo.module import PPOLightningModule
from lightning_ppo.runs.ctrl_c import ctrl_c_exits
from lightning_ppo.runs.errors import TRACEBACK_ENV, UsageError, condense_parser_error, usage_errors_exit
from lightning_ppo.runs.log_continuity import continue_logs
from lightning_ppo.runs.null_args import nulls_as_sections
from lightning_ppo.runs.preflight import (
    check_checkpoint_file,
    check_packages,
    check_precision,
    check_run_inputs,
)
from lightning_ppo.runs.quiet import silence_intended_warnings
from lightning_ppo.runs.run_length import check_step_limit
from lightning_ppo.runs.typos import suggestion
from lightning_ppo.runs.writable import check_configured_folders, class_configs
from lightning_ppo.selfcheck.command import selfcheck_main
from lightning_ppo.serve import main as serve_main
from lightning_ppo.tasks.tiny import ARCHS, DEFAULT_ALPHABET, TinyModelSpec, make_tiny_checkpoint
from lightning_ppo.watch.plot import DEFAULT_KEYS, plot_run
from lightning_ppo.watch.samples import find_latest_samples, format_samples, read_samples

DESCRIPTION = (
    "PPO for RLHF of Hugging Face causal LMs on PyTorch Lightning. "
    "Run `lightning-ppo fit --config CONFIG.yaml`. "
    "Other commands: `lightning-ppo make-tiny --out DIR` writes a tiny offline checkpoint; "
    "`lightning-ppo export CHECKPOINT --out DIR` writes the trained policy in Hugging Face format; "
    "`lightning-ppo plot RUN_DIR` draws a run's curves to a PNG; "
    "`lightning-ppo samples RUN_DIR` prints its latest sampled completions; "
    "`lightning-ppo serve --policy DIR` starts a vLLM generation server (generation.engine: vllm_server); "
    "`lightning-ppo selfcheck` checks that training reaches a known optimum with your Trainer settings. "
    "A mistake in the configuration or inputs is reported in one line (exit status 2); "
    f"{TRACEBACK_ENV}=1 shows its traceback."
)


class PPOLightningCLI(LightningCLI):
    """LightningCLI whose model and data can be any subclass, selected by ``class_path``."""

    def _parse_ckpt_path(self) -> None:
        """Keep the config as given when resuming from a checkpoint file.

        LightningCLI would parse the checkpoint's hyper-parameters over the config (only for a file
        path, not for ``last``), failing on the module's derived entries and silently replacing
        options changed on the command line. The config runs; the module compares it with the
        checkpoint's settings field by field when it loads (``PPOLightningModule._check_resumable``).
        """

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse, then check ``ckpt_path``: LightningCLI reads the checkpoint right after parsing.

        A misspelt key gets the closest valid one: ``...; did you mean kl_coef?``.
        """
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            hint = suggestion(str(err), parser, sys.argv[1:] if args is None else args)
            if hint is None:
                raise
            raise UsageError(f"{condense_parser_error(str(err))}; {hint}") from err
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path:
            check_checkpoint_file(str(ckpt_path))

    def before_instantiate_classes(self) -> None:
        """Check the output folders, and what involves both model and data, before any model is loaded
        (minutes, for big ones)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        _no_cli_optimizer(config)
        reject_fsdp1(config.get("trainer.strategy"))
        check_precision(config.get("trainer.precision"))
        model, data = _as_dict(config.get("model.init_args")), _as_dict(config.get("data.init_args"))
        check_packages(model, config.get("trainer.strategy"))
        _loggers_follow_root(config)
        check_configured_folders(config)
        # Values first (no I/O: the dataclasses check themselves when built), then paths and models.
        if model.get("generation") is not None:
            GenerationConfig(**model["generation"])
        if model.get("lora") is not None:
            LoraSettings(**model["lora"])
        ppo = PPOConfig(**model["ppo"]) if model.get("ppo") is not None else None
        if ppo is not None and not config.get("ckpt_path"):  # resumed: checked once the loop is restored
            check_step_limit(config.get("trainer.max_steps"), ppo)
        if ppo is not None and data.get("batch_size") is not None:
            ppo.check_batch_size(data["batch_size"])
        check_run_inputs(model, data)

    def before_fit(self) -> None:
        """``--ckpt_path last`` with no checkpoint on disk starts a new run, saying so in one line.
        A resumed run continues the logs of the run that wrote its checkpoint: its CSV version
        folder and its W&B run. Before ``fit``: the loggers create both when it starts."""
        key = f"{self.subcommand}.ckpt_path"
        if self.config.get(key) == "last":
            nothing = nothing_to_resume(self.trainer)
            if nothing is not None:
                rank_zero_info(f"lightning_ppo: --ckpt_path last: {nothing}; starting a new run")
                self.config[key] = self.config_init[key] = None  # and no Lightning hint about save_last
        continue_logs(self.trainer, self.config.get(key))


def _as_dict(value: Namespace | dict[str, Any] | None) -> dict[str, Any]:
    return value.as_dict() if isinstance(value, Namespace) else dict(value or {})


def _loggers_follow_root(config: Namespace) -> None:
    """Loggers configured with ``save_dir: null`` write under ``trainer.default_root_dir``."""
    root = config.get("trainer.default_root_dir") or os.getcwd()
    for _, spec in class_configs("trainer.logger", config.get("trainer.logger")):
        init_args = spec.get("init_args")
        if init_args is not None and "save_dir" in init_args and init_args.save_dir is None:
            init_args.save_dir = str(root)


def make_tiny_main(argv: list[str]) -> None:
    """``lightning-ppo make-tiny``: write a tokenizer and a random tiny causal LM to a folder."""
    parser = argparse.ArgumentParser(prog="lightning-ppo make-tiny", description=make_tiny_main.__doc__)
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument(
        "--kind",
        default="causal-lm",
        choices=["causal-lm", "reward"],
        help="a policy, or a one-output sequence classifier used as a reward model",
    )
    parser.add_argument("--arch", default="gpt2", choices=ARCHS)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-positions", type=int, default=128)
    parser.add_argument("--alphabet", default=DEFAULT_ALPHABET, help="characters of the char-level tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    spec = TinyModelSpec(ns.arch, ns.n_layer, ns.n_embd, ns.n_head, ns.n_positions)
    out = make_tiny_checkpoint(ns.out, spec, ns.alphabet, ns.seed, ns.kind)
    print(f"wrote a tiny {ns.arch} {ns.kind} ({ns.n_layer} x {ns.n_embd}) and its tokenizer to {out}")


def plot_main(argv: list[str]) -> Path:
    """``lightning-ppo plot RUN_DIR``: draw a run's curves from its CSV log to a PNG."""
    parser = argparse.ArgumentParser(prog="lightning-ppo plot", description=plot_main.__doc__)
    parser.add_argument("run_dir", help="a CSVLogger folder or any parent of one, e.g. runs/quickstart")
    parser.add_argument("--out", default=None, help="PNG to write (default RUN_DIR/curves.png)")
    parser.add_argument(
        "--keys", nargs="+", default=None, help=f"metrics to draw (default {list(DEFAULT_KEYS)})"
    )
    ns = parser.parse_args(argv)
    try:
        return plot_run(ns.run_dir, ns.out, ns.keys)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))  # one line and exit status 2, not a traceback


def samples_main(argv: list[str]) -> None:
    """``lightning-ppo samples RUN_DIR``: print a run's latest table of samples (``SampleTable``)."""
    parser = argparse.ArgumentParser(prog="lightning-ppo samples", description=samples_main.__doc__)
    parser.add_argument("run_dir", help="the run's folder (e.g. runs/quickstart) or a samples .jsonl file")
    parser.add_argument("--rows", type=int, default=None, help="print at most this many samples")
    ns = parser.parse_args(argv)
    try:
        path = find_latest_samples(ns.run_dir)
    except FileNotFoundError as err:
        parser.error(str(err))  # one line and exit status 2, not a traceback
    rows = read_samples(path)[: ns.rows]
    iteration = rows[0]["iteration"] if rows else "?"
    print(f"{path}: iteration {iteration}, {len(rows)} samples")
    print(format_samples(rows))


def _no_cli_optimizer(config: Namespace) -> None:
    """LightningCLI's own ``--optimizer``/``--lr_scheduler`` replaced the module's
    ``configure_optimizers`` in silence (the policy's and the critic's groups and rates, the
    scheduler check): refused in one line. ``null``, as a config saved by ``fit`` writes them, passes."""
    for key in ("optimizer", "lr_scheduler"):
        if config.get(key) is not None:
            raise UsageError(
                f"{key}: LightningCLI's own --{key} would replace the module's optimizer (its policy and "
                f"critic groups and rates); set model.init_args.{key} instead"
            )


def main(args: list[str] | None = None) -> PPOLightningCLI | int | None:
    """Entry point of the ``lightning-ppo`` console script; ``args`` defaults to ``sys.argv[1:]``.

    Called in-process with ``args``, it returns the CLI (``cli.trainer``, ``cli.model``) for inspection.
    """
    _prepare()
    with ctrl_c_exits(), usage_errors_exit():
        cli = _run(args)
    if args is not None or not isinstance(cli, PPOLightningCLI):  # a subcommand's exit status, or None
        return cli
    # The console script passes our return value to sys.exit: Ctrl-C (saved and stopped) exits 130.
    savers = [cb for cb in cli.trainer.callbacks if isinstance(cb, PPOCheckpoint)]
    return 130 if any(saver.interrupt.requested for saver in savers) else None


def _prepare() -> None:
    import_from_working_directory()
    # Tiny and cached checkpoints load in milliseconds; HF's per-load progress bars are only noise.
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()  # prompt files load in a moment; the bars only push logs away
    silence_intended_warnings()


def fit_in_process(args: list[str]) -> PPOLightningCLI | int | None:
    """``main(args)`` without its exits: a usage error (or a run stopped on purpose) is raised, not
    reported. ``lightning_ppo.selfcheck.selfcheck`` fits through it."""
    _prepare()
    return _run(args)


def import_from_working_directory() -> None:
    """Let ``class_path`` name modules of the current folder (``my_reward.MyReward``), as under ``python -m``.

    ``python -m lightning_ppo.cli`` puts the working directory first on ``sys.path``; the console
    script puts its own folder (the environment's ``bin``) there instead, so a reward module beside
    the config would import only one way. First, as ``python -m`` does: the user's module wins over
    an installed one of the same name.
    """
    cwd = os.getcwd()
    if not any(os.path.abspath(entry) == cwd for entry in sys.path):  # "" is the cwd too
        sys.path.insert(0, cwd)


def _run(args: list[str] | None) -> PPOLightningCLI | int | None:
    """Dispatch to a subcommand; ``fit`` (and LightningCLI's others) run through LightningCLI."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "make-tiny":
        make_tiny_main(argv[1:])
        return None
    if argv and argv[0] == "plot":
        print(f"wrote {plot_main(argv[1:])}")
        return None
    if argv and argv[0] == "samples":
        samples_main(argv[1:])
        return None
    if argv and argv[0] == "serve":
        serve_main(argv[1:])
        return None
    if argv and argv[0] == "selfcheck":  # fits through _run: a run it stops is its FAIL, not exit 2
        return selfcheck_main(argv[1:], fit=_run)
    if argv and argv[0] == "export":
        exported = export_main(argv[1:])
        print(f"wrote {exported.describe()} to {exported.out}")
        return None
    if args is None:  # LightningCLI reads sys.argv itself (and warns when given both)
        sys.argv[1:] = nulls_as_sections(argv, PPOLightningModule)
    else:
        args = nulls_as_sections(argv, PPOLightningModule)
    return PPOLightningCLI(
        PPOLightningModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        # Parse errors are raised, not printed with the usage text and the config dump: main reports them.
        parser_kwargs={"description": DESCRIPTION, "exit_on_error": False},
    )


if __name__ == "__main__":
    sys.exit(main())
