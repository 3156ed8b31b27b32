"""User mistakes end in one line naming the field, file or path (exit status 2), not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ppo.cli import main
from lightning_ppo.errors import TRACEBACK_ENV, UsageError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
NO_MODEL = "/nonexistent/policy"


def _usage_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    """Run the CLI in-process; it must exit with status 2 and one error line, which is returned."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", QUICKSTART, *args])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("lightning-ppo: error: "), errors
    return errors[0]


def _fit_args(tmp_path: Path, policy: Path, *extra: str) -> list[str]:
    """The quickstart, one short iteration of it, on ``policy``, writing only under ``tmp_path``."""
    return [
        "--model.init_args.policy",
        str(policy),
        "--trainer.limit_train_batches",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.logger",
        "false",
        "--trainer.callbacks",
        "[]",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--data.init_args.num_prompts",
        "16",
        "--data.init_args.num_val_prompts",
        "0",
        "--data.init_args.batch_size",
        "8",
        *extra,
    ]


# ----------------------------------------------------------------- reporting


def test_bad_value_from_the_console_is_one_line_and_status_2():
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop(TRACEBACK_ENV, None)
    args = ["fit", "--config", "configs/quickstart.yaml", "--model.init_args.ppo.gamma", "1.5"]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_ppo.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 2 and "ppo.gamma must be in [0, 1], got 1.5" in lines[-1], done.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.init_args.ppo.gamma", "abc"], "model.init_args.ppo.gamma: Expected a float"),
        (["--model.init_args.ppo.gama", "0.5"], "model.init_args: unrecognized arguments: --ppo.gama"),
        (["--trainer.max_epochs", "abc"], "trainer.max_epochs: Expected a int, got abc"),
        (["--config", "/nonexistent/run.yaml"], "config: File does not exist: '/nonexistent/run.yaml'"),
    ],
)
def test_parser_errors_name_the_key_without_usage_or_config_dump(args, expected, capsys):
    line = _usage_error(capsys, *args)
    assert expected in line
    assert "Given value" not in line and "Namespace(" not in line


def test_traceback_variable_lets_the_usage_error_through(monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(UsageError, match="ppo.gamma must be in"):
        main(["fit", "--config", QUICKSTART, "--model.init_args.ppo.gamma", "1.5"])


def test_error_raised_while_building_the_datamodule_is_unwrapped(tiny_digits, tmp_path, capsys):
    # jsonargparse wraps errors of __init__ in a report that dumps the whole model section.
    line = _usage_error(capsys, *_fit_args(tmp_path, tiny_digits, "--data.init_args.batch_size", "0"))
    assert line.endswith("error: batch_size must be at least 1, got 0")
