"""A run that stops by a limit (max_steps, the end of limit_train_batches, max_time) saves its last
iteration, and ``--ckpt_path last`` goes on from there: further with a larger limit, not at all with
the same one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Timer

from lightning_ppo.cli import main
from tests.helpers import Throttle, quickstart_fit_args, ranks_process, saver

STEPS_PER_ITERATION = 4 * 2  # quickstart.yaml: ppo_epochs 4 x num_minibatches 2
# Far more than any run here: only the end of the run can write a checkpoint.
NEVER = 1000


def _fit(policy: Path, root: Path, *extra: str, callbacks: tuple[dict, ...] = ()):
    checkpoints = saver(every_n_iterations=NEVER, monitor="objective/scores", mode="max", save_top_k=1)
    return main(quickstart_fit_args(policy, root, [checkpoints, *callbacks], *extra))


def _saved(root: Path) -> dict:
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)


def _epochs_finished(saved: dict) -> int:
    """Epochs the saved loop state counts as finished: a save after the loop would say 1 mid-epoch."""
    return saved["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"]


def _steps(iterations: int) -> tuple[str, str]:
    return "--trainer.max_steps", str(iterations * STEPS_PER_ITERATION)


# (the limit that stops the first run, the larger one the resumed run is given): max_steps stops
# mid-epoch; limit_train_batches ends the epoch, which a larger max_epochs continues after.
LIMITS = {
    "max_steps": (_steps(3), _steps(5)),
    "limit_train_batches": (
        ("--trainer.limit_train_batches", "3"),
        ("--trainer.limit_train_batches", "3", "--trainer.max_epochs", "2"),
    ),
}
RESUMED_TO = {"max_steps": 5, "limit_train_batches": 6}


@pytest.mark.parametrize("kind", list(LIMITS))
def test_a_run_stopped_by_a_limit_saves_its_last_iteration_and_goes_on_from_it(kind, tiny_digits, tmp_path):
    first, larger = LIMITS[kind]
    stopped = _fit(tiny_digits, tmp_path, *first).model
    assert stopped.iteration == 3
    assert _saved(tmp_path)["ppo_state"]["iteration"] == 3 and _epochs_finished(_saved(tmp_path)) == 0
    assert [p.name for p in (tmp_path / "checkpoints").glob("iteration=*.ckpt")] == ["iteration=3.ckpt"]

    resumed = _fit(tiny_digits, tmp_path, *larger, "--ckpt_path", "last").model
    assert resumed.iteration == RESUMED_TO[kind]
    assert _saved(tmp_path)["ppo_state"]["iteration"] == RESUMED_TO[kind]


def test_resuming_a_finished_run_trains_nothing_and_keeps_its_last_ckpt(tiny_digits, tmp_path):
    _fit(tiny_digits, tmp_path, *_steps(2))
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.stat()
    again = _fit(tiny_digits, tmp_path, *_steps(2), "--ckpt_path", "last")
    assert again.model.iteration == 2
    after = last.stat()  # not rewritten (a save replaces the file: a new inode)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def _throttle(seconds: float) -> dict:
    return {"class_path": "tests.helpers.Throttle", "init_args": {"seconds": seconds}}


def _run_for(seconds: int) -> tuple[str, str]:
    return "--trainer.max_time", json.dumps({"seconds": seconds})


def test_max_time_saves_the_iteration_it_stopped_at_and_counts_time_across_resumes(tiny_digits, tmp_path):
    # Each iteration takes at least 0.4 s: a 1 s budget stops after a few of the epoch's 50.
    slow = (_throttle(0.4),)
    stopped = _fit(tiny_digits, tmp_path, *_run_for(1), callbacks=slow).model
    saved = _saved(tmp_path)
    assert 1 <= stopped.iteration < 50
    assert saved["ppo_state"]["iteration"] == stopped.iteration
    elapsed = saved["callbacks"]["Timer"]["time_elapsed"]["train"]
    assert elapsed >= 1.0  # Lightning's Timer saves the training time spent, up to the stop

    # The same max_time again: the budget is spent (the Timer restores it), nothing trains.
    same = _fit(tiny_digits, tmp_path, *_run_for(1), "--ckpt_path", "last", callbacks=slow)
    assert same.model.iteration == stopped.iteration
    assert _saved(tmp_path)["ppo_state"]["iteration"] == stopped.iteration

    # A larger one: it goes on from the saved iteration, with the time already spent counted.
    more = _fit(tiny_digits, tmp_path, *_run_for(3), "--ckpt_path", "last", callbacks=slow)
    (throttle,) = [cb for cb in more.trainer.callbacks if isinstance(cb, Throttle)]
    assert throttle.done >= 1
    assert more.model.iteration == stopped.iteration + throttle.done
    assert _saved(tmp_path)["ppo_state"]["iteration"] == more.model.iteration
    (timer,) = [cb for cb in more.trainer.callbacks if isinstance(cb, Timer)]
    carried = timer.time_elapsed() - (timer.end_time() - timer.start_time())
    assert carried == pytest.approx(elapsed)
    assert timer.time_elapsed() >= 3.0


@pytest.mark.ranks
def test_under_ddp_every_rank_saves_the_last_iteration_together(tiny_digits, tmp_path):
    # A save is a collective (the Trainer's barrier): a rank that skipped it would hang the other.
    ranks = ("--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")
    checkpoints = saver(every_n_iterations=NEVER)
    done = ranks_process(quickstart_fit_args(tiny_digits, tmp_path, [checkpoints], *ranks, *_steps(3)))
    assert done.returncode == 0, done.stderr[-3000:]
    saved = _saved(tmp_path)
    assert saved["ppo_state"]["iteration"] == 3 and _epochs_finished(saved) == 0  # saved in the loop
    assert saved["ppo_state"]["rng_states"].shape[0] == 2
