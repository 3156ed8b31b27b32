"""Every checkpoint the CLI writes resumes, by path or as ``last``, bit for bit; a changed config is
named field by field (an error where the saved weights cannot fit, a warning where they can)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_ppo.cli import main
from tests.helpers import cli_usage_error, quickstart_fit_args, saver

ROOT = Path(__file__).resolve().parents[1]
STEPS_PER_ITERATION = 4 * 2  # quickstart.yaml: ppo_epochs 4 x num_minibatches 2
TOTAL = 6


def _args(policy: Path, root: Path, iterations: int, *extra: str) -> list[str]:
    checkpoints = saver(
        every_n_iterations=2, dirpath=str(root / "ckpt"), monitor="objective/scores", mode="max", save_top_k=1
    )
    steps = ("--trainer.max_steps", str(iterations * STEPS_PER_ITERATION))
    return quickstart_fit_args(policy, root, [checkpoints], *steps, *extra)


@pytest.fixture(scope="module")
def runs(tiny_digits, tmp_path_factory):
    """The uninterrupted run of TOTAL iterations, and a run stopped after 4 with its checkpoints
    (iterations 2 and 4: last.ckpt at 4, the best by score at 2 or 4)."""
    full = main(_args(tiny_digits, tmp_path_factory.mktemp("full"), TOTAL)).model
    half_root = tmp_path_factory.mktemp("half")
    main(_args(tiny_digits, half_root, 4))
    return full, half_root


def _best(ckpt_dir: Path) -> Path:
    (best,) = [p for p in ckpt_dir.glob("*.ckpt") if p.name != "last.ckpt"]
    return best


@pytest.mark.parametrize("which", ["last", "path of last.ckpt", "path of the best"])
def test_every_checkpoint_resumes_bitwise(which, runs, tiny_digits, tmp_path):
    full, half_root = runs
    ckpt_dir = half_root / "ckpt"
    ckpt = {"last": "last", "path of last.ckpt": str(ckpt_dir / "last.ckpt")}.get(which) or str(
        _best(ckpt_dir)
    )
    # "last" is looked up in the checkpoint callback's folder: resume in the interrupted run's root
    root = half_root if which == "last" else tmp_path
    resumed = main([*_args(tiny_digits, root, TOTAL), "--ckpt_path", ckpt]).model
    assert resumed.iteration == full.iteration == TOTAL
    for name, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_changed_settings_that_fit_warn_field_by_field(runs, tiny_digits, tmp_path):
    _, half_root = runs
    changed = [
        *("--model.init_args.generation.max_new_tokens", "6"),
        *("--model.init_args.ppo.num_minibatches", "4"),
        # 4 iterations of 8 steps in the checkpoint, then 16 per iteration: one more is step 48
        *("--trainer.max_steps", str(4 * STEPS_PER_ITERATION + 16)),
    ]
    with pytest.warns(UserWarning, match="differ from the checkpoint") as record:
        resumed = main(
            [*_args(tiny_digits, tmp_path, 5, *changed), "--ckpt_path", str(half_root / "ckpt" / "last.ckpt")]
        ).model
    message = str([w.message for w in record if "differ from the checkpoint" in str(w.message)][0])
    assert "model.generation.max_new_tokens: 8 in the checkpoint, 6 now" in message
    assert "model.ppo.num_minibatches: 2 in the checkpoint, 4 now" in message
    assert resumed.iteration > 4  # it went on from the checkpoint


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (["--model.init_args.value_model", "shared"], "model.value_model: 'separate' in the checkpoint"),
        (
            ["--model.init_args.lora", json.dumps({"r": 4, "alpha": 8, "dropout": 0.0})],
            "model.lora: None in the checkpoint, {",
        ),
        (["--model.init_args.ppo.advantage_estimator", "grpo"], "model.ppo.advantage_estimator"),
    ],
    ids=["value_model", "lora", "estimator"],
)
def test_changed_settings_that_cannot_fit_fail_naming_them(
    change, field, runs, tiny_digits, tmp_path, capsys
):
    _, half_root = runs
    extra = [*change, "--model.init_args.ppo.num_generations", "2"] if "grpo" in change else change
    args = [*_args(tiny_digits, tmp_path, 5, *extra), "--ckpt_path", str(half_root / "ckpt" / "last.ckpt")]
    message = cli_usage_error(capsys, args)
    assert "do not fit this model" in message and field in message
