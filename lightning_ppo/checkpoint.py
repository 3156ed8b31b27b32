"""Exact resume: the PPO state beyond Lightning's, and a checkpoint callback counted in iterations.

Lightning saves weights, optimizer, scheduler and loop progress. A PPO run also carries the KL
controller, its counters and the score statistics from one iteration to the next (:class:`PPOState`),
and each iteration consumes random numbers (sampling), so a run resumed without them samples
different responses and drifts from the uninterrupted one. The sampling state of every rank is
saved here, as plain tensors, so checkpoints still load with ``weights_only=True``.

:func:`with_old_paths` allow-lists classes for ``torch.serialization.safe_globals`` under their
names from before the package's modules moved too (``lightning_ppo._moved``).
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

# public here: the allow-list that reads a file pickled before the modules moved (docs/resuming.md)
from lightning_ppo._moved import with_old_paths as with_old_paths
from lightning_ppo.distributed.sharded_checkpoint import remove_stale_folders
from lightning_ppo.runs.checkpoint_io import install_atomic_checkpoint_io, remove_stale_temp_files
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.log_continuity import LOGS_KEY, checkpoint_to_load, logger_records
from lightning_ppo.runs.quiet import DropMessages, stop_dropping, stopped_mid_epoch
from lightning_ppo.runs.run_lock import RunLock
from lightning_ppo.runs.warn import warn
from lightning_ppo.runs.writable import ensure_writable
from lightning_ppo.watch.guardrails import Guardrails


def rng_state(device: torch.device) -> Tensor:
    """This process's torch RNG state (CPU, and the current CUDA device's when on one) as one uint8 tensor."""
    state = torch.get_rng_state()
    if device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    return state


def set_rng_state(state: Tensor, device: torch.device) -> None:
    """Inverse of :func:`rng_state`."""
    cpu_size = torch.get_rng_state().numel()
    # Copies: a view into a rank's row of the saved states (storage offset > 0) crashes
    # torch.set_rng_state (a segfault, torch 2.13).
    torch.set_rng_state(state[:cpu_size].cpu().clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[cpu_size:].cpu().clone(), device)


def gather_rng_states(module: LightningModule) -> Tensor:
    """(world_size, S) RNG states of all ranks; every rank must call this (it is a collective)."""
    local = rng_state(module.device)
    if module.trainer.world_size == 1:
        return local[None]
    # all_gather needs the backend's device (CUDA under NCCL); the bytes survive the round trip.
    gathered = module.all_gather(local.to(module.device))
    return gathered.cpu()


def restore_rng_states(module: LightningModule, states: Tensor) -> None:
    """Give this rank its saved RNG state back (if the world size is unchanged)."""
    rank, world = module.trainer.global_rank, module.trainer.world_size
    if states.shape[0] != world:
        warn(
            f"the checkpoint holds RNG states of {states.shape[0]} processes but this run has {world}: "
            "sampling continues from freshly seeded generators, so it will not match the original run"
        )
        return
    set_rng_state(states[rank], module.device)


PPO_STATE_KEY = "ppo_state"  # the checkpoint's entry for PPOState


@dataclass
class PPOState:
    """What a PPO run carries from one iteration to the next besides weights, optimizer and loop
    progress: ``checkpoint["ppo_state"]``, a dict of plain values and tensors (:meth:`to_dict`).

    Checkpoints written before a field existed lack its key: :meth:`from_dict` leaves it ``None``
    (or 0), and :meth:`restore` leaves that part of the module as it is (or counts from 0).
    """

    kl_coef: float | None = None  # the coefficient alone: all that checkpoints before kl_controller kept
    kl_controller: dict[str, Any] | None = None
    iteration: int = 0
    episodes: int = 0
    score_moments: dict[str, float] | None = None
    smoothed_score: dict[str, Any] | None = None
    consecutive_skips: int = 0  # optimizer steps with NaN/inf gradients, in a row
    rng_states: Tensor | None = None  # (world_size, S): every rank's sampling state
    guardrails: dict[str, Any] | None = None  # watch.guardrails.Guardrails.state_dict; None before the first
    unscored_seen: bool = False  # a row no reward scored: reward/unscored is logged from then on
    dropped_in_a_row: int = 0  # iterations whose every sample was dropped, in a row

    @classmethod
    def of(cls, module: LightningModule) -> PPOState:
        """A ``PPOLightningModule``'s state; every rank must call this (it gathers the RNG states)."""
        return cls(
            kl_coef=float(module.kl_ctl.value),
            kl_controller=module.kl_ctl.state_dict(),
            iteration=module.iteration,
            episodes=module.episodes,
            score_moments=module.score_moments.state_dict(),
            smoothed_score=module.smoothed_score.state_dict(),
            consecutive_skips=module.consecutive_skips,
            rng_states=gather_rng_states(module),
            guardrails=module.guardrails.state_dict() if module.guardrails is not None else None,
            unscored_seen=module.scorer.seen_unscored,
            dropped_in_a_row=module.dropped_in_a_row,
        )

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's ``ppo_state``: these keys, in this order, as every checkpoint has had them."""
        return {
            "kl_coef": self.kl_coef,
            "kl_controller": self.kl_controller,
            "iteration": self.iteration,
            "episodes": self.episodes,
            "score_moments": self.score_moments,
            "smoothed_score": self.smoothed_score,
            "consecutive_skips": self.consecutive_skips,
            "rng_states": self.rng_states,
            "guardrails": self.guardrails,
            "unscored_seen": self.unscored_seen,
            "dropped_in_a_row": self.dropped_in_a_row,
        }

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> PPOState:
        """Inverse of :meth:`to_dict`, for checkpoints of any age (an empty dict: none saved)."""
        return cls(
            kl_coef=saved.get("kl_coef"),
            kl_controller=saved.get("kl_controller"),
            iteration=saved.get("iteration", 0),
            episodes=saved.get("episodes", 0),
            score_moments=saved.get("score_moments"),
            smoothed_score=saved.get("smoothed_score"),
            consecutive_skips=saved.get("consecutive_skips", 0),
            rng_states=saved.get("rng_states"),
            guardrails=saved.get("guardrails"),
            unscored_seen=saved.get("unscored_seen", False),
            dropped_in_a_row=saved.get("dropped_in_a_row", 0),
        )

    def restore(self, module: LightningModule) -> None:
        """Give a ``PPOLightningModule`` this state back (each rank its own RNG state, under a Trainer)."""
        saved_kl = self.kl_controller
        if saved_kl is None:  # checkpoints before the controller had state: the coefficient alone
            saved_kl = {"value": module.kl_ctl.value if self.kl_coef is None else self.kl_coef}
        module.kl_ctl.load_state_dict(saved_kl)
        module.iteration = self.iteration
        module.episodes = self.episodes
        module.consecutive_skips = self.consecutive_skips
        module.dropped_in_a_row = self.dropped_in_a_row
        if self.score_moments is not None:
            module.score_moments.load_state_dict(self.score_moments)
        if self.smoothed_score is not None:
            module.smoothed_score.load_state_dict(self.smoothed_score)
        if self.guardrails is not None:  # warnings given stay given; windows keep the run's start
            module.guardrails = Guardrails.restored(module.ppo, self.guardrails)
        module.scorer.seen_unscored = self.unscored_seen
        if self.rng_states is not None and module._trainer is not None:
            restore_rng_states(module, self.rng_states)


def frozen_names(module: torch.nn.Module) -> set[str]:
    """The names of ``module``'s frozen parameters (reference, reward models, a LoRA base), shared ones
    under each of their names."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def without_frozen(state_dict: dict[str, Tensor], module: torch.nn.Module) -> dict[str, Tensor]:
    """``state_dict`` without ``module``'s frozen weights: a resumed run reloads those from their own
    checkpoints, so saving them would only copy what is on disk already."""
    frozen = frozen_names(module)
    return {k: v for k, v in state_dict.items() if k not in frozen}


class PPOCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that saves every ``every_n_iterations`` PPO iterations, the last, and on Ctrl-C.

    Under manual optimization Lightning counts optimizer steps (``ppo_epochs x minibatches`` per
    iteration), which makes ``every_n_train_steps`` awkward; this counts iterations. Everything
    else is ``ModelCheckpoint``: ``save_last=True`` keeps ``last.ckpt`` for ``fit --ckpt_path
    last``, ``monitor="objective/scores_smoothed", mode="max", save_top_k=1`` keeps the best by the mean score
    of the last 10 iterations (one batch's mean is noisy: the best single batch is mostly luck).

    The folder defaults to ``<trainer.default_root_dir>/checkpoints``, the same for every run in
    that root, so ``--ckpt_path last`` finds it. A new run (no ``ckpt_path``) refuses to start
    in a folder that holds another run's ``last.ckpt``, instead of mixing the two runs' files, and
    while it trains it holds the folder's lock (:mod:`lightning_ppo.runs.run_lock`), so a run started at
    the same moment in the same folder is refused too.

    Ctrl-C during training finishes the current iteration, saves (top-k and last), and stops;
    ``fit --ckpt_path last`` then resumes exactly. A second Ctrl-C interrupts at once. The last
    iteration of a run that ends otherwise (``max_time``, ``max_steps``, the end of the last epoch,
    a callback that sets ``trainer.should_stop``) is saved the same way, so ``--ckpt_path last``
    with a larger limit goes on from where it stopped, and with the same limits trains nothing.

    Each checkpoint also records where the run logs (CSV version, W&B run id), so that a run resumed
    from it continues the same logs (:mod:`lightning_ppo.runs.log_continuity`).

    At setup it checks that the folder can be written (before any training), removes temporary
    files and folders that killed runs left there, and makes the trainer save through
    :class:`~lightning_ppo.runs.checkpoint_io.AtomicCheckpointIO`, so an interrupted or failed save
    never leaves a half-written checkpoint in place (sharded folders:
    :mod:`lightning_ppo.distributed.sharded_checkpoint`).

    Args:
        every_n_iterations: Save after every this many PPO iterations (>= 1).
        save_last: Keep ``last.ckpt``, the checkpoint ``fit --ckpt_path last`` resumes from.
        filename: Name of the top-k files; ``{iteration}`` gives ``iteration=211.ckpt`` (Lightning's
            default, ``{epoch}-{step}``, counts optimizer steps, ``ppo_epochs x minibatches`` per iteration).
        **kwargs: Any ``ModelCheckpoint`` argument (``dirpath``, ``monitor``, ``save_top_k``, ...).
    """

    def __init__(
        self,
        every_n_iterations: int = 50,
        save_last: bool | None = True,
        filename: str | None = "{iteration}",
        **kwargs: Any,
    ) -> None:
        if every_n_iterations < 1:
            raise UsageError(f"PPOCheckpoint.every_n_iterations must be >= 1, got {every_n_iterations}")
        super().__init__(save_last=save_last, filename=filename, **kwargs)
        self.every_n_iterations = every_n_iterations
        self.interrupt = InterruptRequest()
        self.lock = RunLock(".")  # the real folder's once training starts
        self._resumed_here = False
        self.saved_iteration: int | None = None  # of this run's latest save (for error messages)
        self._dropper: DropMessages | None = None

    def _monitor_candidates(self, trainer: Trainer) -> dict[str, Tensor]:
        # The values filenames are formatted from: the PPO iteration, as an integer (the logged
        # metric is a float, which would name files "iteration=211.0").
        candidates = super()._monitor_candidates(trainer)
        candidates["iteration"] = torch.tensor(getattr(trainer.lightning_module, "iteration", 0))
        return candidates

    def _default_dirpath(self, trainer: Trainer) -> None:
        # Not Lightning's default (the first logger's versioned folder): a new version per run
        # would hide the previous run's last.ckpt from `--ckpt_path last`.
        if self.dirpath is None:
            self.dirpath = os.path.realpath(os.path.join(trainer.default_root_dir, "checkpoints"))

    def _find_last_checkpoints(self, trainer: Trainer) -> set[str]:
        self._default_dirpath(trainer)  # "last" is looked up before setup() runs
        return super()._find_last_checkpoints(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._lock_run_folder(trainer)
        last = os.path.join(str(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
        # A run resumed from a checkpoint in this folder owns its last.ckpt; any other run would mix
        # its files with the one that wrote it (Lightning would add last-v1.ckpt beside it).
        if os.path.exists(last) and not self._resumed_here:
            this = "this run" if trainer.ckpt_path is None else f"this run, resumed from {trainer.ckpt_path},"
            raise RunFolderInUseError(
                f"{last} belongs to an earlier run: resume it with `--ckpt_path last`, start {this} "
                "elsewhere with `--trainer.default_root_dir DIR` (or the checkpoint callback's dirpath), "
                "or delete that folder"
            )
        self.interrupt.listen()

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._default_dirpath(trainer)
        super().setup(trainer, pl_module, stage)
        install_atomic_checkpoint_io(trainer.strategy)
        if trainer.is_global_zero and stage == "fit":
            ensure_writable(self.dirpath, f"{type(self).__name__}.dirpath")
            remove_stale_temp_files(self.dirpath)
            remove_stale_folders(self.dirpath)  # of sharded (FSDP2) saves

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx
    ) -> None:
        iteration = getattr(pl_module, "iteration", 0)
        # Every rank stops at the same iteration, whichever of them saw the signal.
        interrupted = trainer.strategy.reduce_boolean_decision(self.interrupt.requested, all=False)
        due = iteration > 0 and iteration % self.every_n_iterations == 0
        if interrupted:
            trainer.should_stop = True
            rank_zero_info(
                f"lightning_ppo: Ctrl-C: saving iteration {iteration} to {self.dirpath} and stopping; "
                "resume with `--ckpt_path last`"
            )
        # The loop's last iteration (max_time, max_steps, the last epoch's last batch, Ctrl-C) is
        # saved here, mid-loop like the periodic saves, so that `--ckpt_path last` with a larger
        # limit goes on from it.
        last = fit_ends_after_this_batch(trainer)
        if stops_early(trainer) and not epoch_ends_after_this_batch(trainer) and self._dropper is None:
            # Stopped mid-epoch (Ctrl-C, max_time): Lightning would still say "max_epochs=1 reached".
            self._dropper = stopped_mid_epoch()
        if (due or interrupted or last) and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
            self.saved_iteration = iteration

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Where this run logs, for a resumed run to continue it (lightning_ppo.runs.log_continuity);
        # rank 0's checkpoint is the one written, and only it has the loggers' experiments.
        if trainer.is_global_zero:
            checkpoint[LOGS_KEY] = logger_records(trainer.loggers)

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Called just before load_state_dict: whether the checkpoint resumed from sits in this folder.
        resumed = trainer.ckpt_path
        here = (
            resumed is not None
            and os.path.realpath(os.path.dirname(os.path.normpath(resumed))) == self.dirpath
        )
        self._resumed_here = here

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A run resumed from a checkpoint in its own folder, written when that folder had another path
        (moved or copied since), keeps its files as its own: ``last.ckpt`` is overwritten, not joined
        by ``last-v1.ckpt``, and top-k keeps counting its best files (Lightning drops that state when
        the saved folder's path differs from this one's)."""
        saved = state_dict.get("dirpath")
        if self._resumed_here and saved is not None and saved != self.dirpath:
            state_dict = rebased(state_dict, str(saved), str(self.dirpath))
        super().load_state_dict(state_dict)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Not ModelCheckpoint's fallback save of last.ckpt after the loop (when nothing was saved):
        # the loop state then marks the epoch finished, so a run stopped mid-epoch would resume into
        # the next epoch, or at max_epochs not at all. on_train_batch_end has saved the last
        # iteration with the state of a periodic save.
        self.interrupt.release()
        self.lock.release()
        stop_dropping(self._dropper)
        self._dropper = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.interrupt.release()
        self.lock.release()
        stop_dropping(self._dropper)
        self._dropper = None

    def _lock_run_folder(self, trainer: Trainer) -> None:
        """Take the folder's lock (rank 0); every rank refuses together when another run holds it."""
        self.lock = RunLock(str(self.dirpath))
        holder = self.lock.acquire() if trainer.is_global_zero else None
        holder = trainer.strategy.broadcast(holder)
        if holder is not None:
            raise RunFolderInUseError(
                f"{self.dirpath} is in use by another run ({holder}): start this run elsewhere with "
                "`--trainer.default_root_dir DIR` (or the checkpoint callback's dirpath), or wait for it"
            )


def newest_checkpoint(trainer: Trainer | None) -> str:
    """For an error that stops training: the newest checkpoint this run wrote, as a sentence (the
    files Lightning's other checkpoint callbacks wrote count too, without their iteration)."""
    savers = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)] if trainer else []
    ours = [(cb.saved_iteration, cb._last_checkpoint_saved) for cb in savers if isinstance(cb, PPOCheckpoint)]
    ours = [(iteration, path) for iteration, path in ours if iteration is not None and path]
    if ours:
        iteration, path = max(ours)
        return f"The newest checkpoint is {path}, of iteration {iteration}."
    others = [cb._last_checkpoint_saved for cb in savers if cb._last_checkpoint_saved]
    if others:
        return f"The newest checkpoint is {others[-1]}."
    if trainer is not None and trainer.ckpt_path is not None:
        return f"This run saved no checkpoint since it resumed from {trainer.ckpt_path}."
    return "This run saved no checkpoint."


def nothing_to_resume(trainer: Trainer) -> str | None:
    """Why ``fit --ckpt_path last`` finds no checkpoint (a sentence), or ``None`` when it finds one.

    Not an error: a job script that always passes ``--ckpt_path last`` (requeued on a cluster)
    starts a new run the first time.
    """
    if checkpoint_to_load(trainer, "last") is not None:
        return None
    savers = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.save_last]
    folders = sorted({str(cb.dirpath) for cb in savers})
    if not folders:
        return "no checkpoint callback saves a last checkpoint, so there is nothing to resume"
    return f"no last.ckpt in {' or '.join(folders)}: nothing to resume"


def rebased(state: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """``ModelCheckpoint`` state with the paths of files in folder ``old`` moved to folder ``new``."""

    def move(path: Any) -> Any:
        if isinstance(path, str) and path and os.path.dirname(path) == old:
            return os.path.join(new, os.path.basename(path))
        return path

    moved = {key: move(value) for key, value in state.items()}
    moved["dirpath"] = new
    if isinstance(state.get("best_k_models"), dict):
        moved["best_k_models"] = {move(path): score for path, score in state["best_k_models"].items()}
    return moved


def fit_ends_after_this_batch(trainer: Trainer) -> bool:
    """Whether the fit loop stops after the batch that just ended, by the checks Lightning makes.

    Lightning's ``Timer`` (``max_time``) sets ``trainer.should_stop`` in its ``on_train_batch_end``,
    which runs before a checkpoint callback's (Lightning orders checkpoint callbacks last). Every
    input is the same on every rank, so every rank takes part in the save. A stop decided later
    (the module's own ``on_train_batch_end``, an ``EarlyStopping`` at the end of an epoch) is not
    seen here: it stops with the latest periodic save.
    """
    fit_loop = trainer.fit_loop
    if stops_early(trainer):
        return True
    if 0 <= fit_loop.max_steps <= trainer.global_step:  # -1: no limit
        return True
    return epoch_ends_after_this_batch(trainer) and 0 <= fit_loop.max_epochs <= trainer.current_epoch + 1


def stops_early(trainer: Trainer) -> bool:
    """Whether a stop was asked for (``trainer.should_stop``) and the loop will obey it after this batch."""
    return trainer.should_stop and trainer.fit_loop._can_stop_early  # min_steps/min_epochs unmet: goes on


def epoch_ends_after_this_batch(trainer: Trainer) -> bool:
    batches = trainer.fit_loop.epoch_loop.batch_progress
    return batches.is_last_batch or batches.current.ready >= trainer.num_training_batches


class RunFolderInUseError(UsageError, FileExistsError):
    """A new run was pointed at a checkpoint folder that holds another run's ``last.ckpt``."""


class InterruptRequest:
    """Turns the first SIGINT (Ctrl-C) into a request read at the end of an iteration.

    A KeyboardInterrupt raised mid-iteration would leave the weights updated by some of the
    iteration's optimizer steps and not others: no consistent point to save. The second SIGINT
    restores the previous handler's behaviour and interrupts at once.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def listen(self) -> None:
        self.requested = False
        # Signal handlers can only be set from the main thread (not, e.g., in a notebook's worker).
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            self.release()
            raise KeyboardInterrupt(
                "aborted by a second Ctrl-C: the iteration under way is lost; `--ckpt_path last` resumes "
                "from the newest checkpoint"
            )
        self.requested = True
        rank_zero_info("lightning_ppo: Ctrl-C: finishing this iteration, then saving; Ctrl-C again to abort")

    def release(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
