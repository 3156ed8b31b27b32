"""What a run says and leaves behind in the cases where Lightning's own words or habits contradicted
the package (issue 19, items 6, 10 and 11): a moved run folder, warnings that do not apply, Ctrl-C
at start-up, field names without their section, row numbers, the prompt the reward sees."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from lightning_ppo.cli import main
from tests.helpers import quickstart_fit_args, saver

STEPS_PER_ITERATION = 4 * 2  # quickstart.yaml: ppo_epochs 4 x num_minibatches 2


def _run_args(policy: Path, root: Path, iterations: int, *extra: str) -> list[str]:
    """The quickstart for ``iterations`` PPO iterations (a step limit: resumable), its checkpoints in
    ``root/checkpoints`` (the default folder), the best kept by score."""
    checkpoints = saver(every_n_iterations=1, monitor="objective/scores", mode="max", save_top_k=1)
    steps = ("--trainer.max_steps", str(iterations * STEPS_PER_ITERATION))
    return quickstart_fit_args(policy, root, [checkpoints], *steps, *extra, prompts=64)


def _iteration(path: Path) -> int:
    return torch.load(path, weights_only=True)["ppo_state"]["iteration"]


def test_a_moved_run_folder_resumes_into_its_own_last_ckpt(tiny_digits, tmp_path):
    """Item 6: Lightning forgets a checkpoint folder's files when its path changed and wrote
    ``last-v1.ckpt`` beside the moved ``last.ckpt``; a resumed run now overwrites its own."""
    main(_run_args(tiny_digits, tmp_path / "first", 2))
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "first", moved)
    main([*_run_args(tiny_digits, moved, 3), "--ckpt_path", "last"])
    files = sorted(p.name for p in (moved / "checkpoints").glob("*.ckpt"))
    assert "last-v1.ckpt" not in files and len(files) == 2, files  # last.ckpt and one best (top-1)
    assert _iteration(moved / "checkpoints" / "last.ckpt") == 3
