"""Lightning's CSV and W&B loggers, writing under the Trainer's ``default_root_dir`` unless told.

Lightning's own loggers need their folder in the config (``CSVLogger`` requires ``save_dir``,
``WandbLogger`` defaults to the working directory), so a config that names ``default_root_dir``
had to repeat it for every logger, and ``--trainer.default_root_dir`` on the command line moved
the checkpoints but not the logs. These take ``save_dir: null`` (the default) to mean "the run's
folder"; ``lightning-ppo fit`` fills it in from ``trainer.default_root_dir`` before they are built.
Built in Python without ``save_dir``, they write under the working directory, as Lightning's do.

A resumed run continues its first part's logs: ``CSVLogger.continue_log`` and
``WandbLogger.continue_run``, which ``lightning-ppo fit --ckpt_path`` calls
(:mod:`lightning_ppo.runs.log_continuity`).
"""

from __future__ import annotations

import csv
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch import loggers
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class CSVLogger(loggers.CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` with ``save_dir`` defaulting to the run's folder.

    It writes every row as it is logged (Lightning's buffers 100): a PPO iteration is long, a killed
    run keeps its rows up to the kill (a resumed run continues them), and ``lightning-ppo plot``
    draws a running run up to its latest iteration.

    Args:
        save_dir: Parent folder of the logs; ``None``: ``trainer.default_root_dir`` (under the CLI).
        name: Sub-folder of the experiment.
        version: Sub-folder of this run (``version_<n>`` for a number); ``None``: the next number, or
            when the run resumes from a checkpoint, the version its first part logged to.
        flush_logs_every_n_steps: Write the rows to ``metrics.csv`` every this many steps.
        **kwargs: Any other ``lightning.pytorch.loggers.CSVLogger`` argument.
    """

    def __init__(
        self,
        save_dir: str | None = None,
        name: str = "csv",
        version: int | str | None = None,
        flush_logs_every_n_steps: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            save_dir=save_dir or ".",
            name=name,
            version=version,
            flush_logs_every_n_steps=flush_logs_every_n_steps,
            **kwargs,
        )
        self._given_version = version
        self._continues = False

    def continue_log(self, version: int | str) -> None:
        """Log to ``version`` (unless a version was given) and continue its ``metrics.csv``.

        For a run resumed from a checkpoint: the rows logged before it are kept, and those at the
        steps the resumed run logs again (written after the checkpoint) give way to the new ones.
        Call it before anything is logged.
        """
        if self._experiment is not None:
            raise RuntimeError("continue_log must be called before the logger writes its first row")
        if self._given_version is None:
            self._version = version
        self._continues = True

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None and self._continues:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuedExperimentWriter(log_dir=self.log_dir)
        return super().experiment


class ContinuedExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer, appending to the ``metrics.csv`` of a run it continues.

    Lightning's writer deletes the file it finds. This one keeps it, and when it first writes, drops
    the rows at its first step and later: the interrupted run logged them after the checkpoint the
    run resumed from, and the resumed run logs those steps again. One row per step and metric, then.
    """

    def _check_log_dir_exists(self) -> None:
        # Called by the base __init__ where Lightning's writer deletes the file: read its columns instead.
        self._drop_from_first_step = True
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = list(csv.DictReader(file).fieldnames or [])

    def save(self) -> None:
        if self.metrics and self._drop_from_first_step:
            self._drop_rows_from(min(int(row["step"]) for row in self.metrics))
            self._drop_from_first_step = False
        super().save()

    def _drop_rows_from(self, step: int) -> None:
        if not self._fs.isfile(self.metrics_file_path):
            return
        if not self.metrics_keys:  # an empty file: nothing to keep
            self._fs.rm_file(self.metrics_file_path)
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            rows = [row for row in csv.DictReader(file) if _step(row) < step]
        # A new file renamed over the old: a crash mid-write leaves the old rows, not half of them.
        partial = f"{self.metrics_file_path}.partial"
        with self._fs.open(partial, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(rows)
        self._fs.mv(partial, self.metrics_file_path)


def _step(row: dict[str, str]) -> float:
    try:
        return float(row.get("step") or "nan")
    except ValueError:
        return float("nan")


class WandbLogger(loggers.WandbLogger):
    """``lightning.pytorch.loggers.WandbLogger`` with ``save_dir`` defaulting to the run's folder.

    Args:
        save_dir: Parent folder of the ``wandb`` run folder; ``None``: ``trainer.default_root_dir``
            (under the CLI).
        **kwargs: Any other ``lightning.pytorch.loggers.WandbLogger`` argument (``project``,
            ``name``, ``offline``, ...).
    """

    def __init__(self, save_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(save_dir=save_dir or ".", **kwargs)
        # Lightning always passes wandb.init an `anonymous` entry, which wandb 0.31 has deprecated
        # and warns about on every run even when it is None.
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

    def continue_run(self, run_id: str) -> None:
        """Log to the W&B run ``run_id`` (unless an ``id`` was given), as a run resumed from a checkpoint.

        Lightning asks W&B with ``resume="allow"``: online, the run goes on; offline, W&B writes a
        new ``offline-run-*-<run_id>`` folder that ``wandb sync`` uploads into the same run. Call it
        before anything is logged.
        """
        if self._experiment is not None:
            raise RuntimeError("continue_run must be called before the W&B run starts")
        if self._wandb_init.get("id") is None:
            self._wandb_init["id"] = self._id = run_id
