"""Lightning's CSV and W&B loggers, writing under the Trainer's ``default_root_dir`` unless told.

Lightning's own loggers need their folder in the config (``CSVLogger`` requires ``save_dir``,
``WandbLogger`` defaults to the working directory), so a config that names ``default_root_dir``
had to repeat it for every logger, and ``--trainer.default_root_dir`` on the command line moved
the checkpoints but not the logs. These take ``save_dir: null`` (the default) to mean "the run's
folder"; ``lightning-ppo fit`` fills it in from ``trainer.default_root_dir`` before they are built.
Built in Python without ``save_dir``, they write under the working directory, as Lightning's do.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import loggers


class CSVLogger(loggers.CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` with ``save_dir`` defaulting to the run's folder.

    Args:
        save_dir: Parent folder of the logs; ``None``: ``trainer.default_root_dir`` (under the CLI).
        name: Sub-folder of the experiment.
        **kwargs: Any other ``lightning.pytorch.loggers.CSVLogger`` argument.
    """

    def __init__(self, save_dir: str | None = None, name: str = "csv", **kwargs: Any) -> None:
        super().__init__(save_dir=save_dir or ".", name=name, **kwargs)


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
