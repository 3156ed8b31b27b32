"""Exact resume: N iterations + a resumed N equal 2N uninterrupted iterations, bit for bit."""

from __future__ import annotations

from functools import partial

import lightning.pytorch as pl
import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.checkpoint import PPOCheckpoint
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward
from tests.helpers import quiet_trainer

EPOCHS, MINIBATCHES = 2, 2
KEYS = ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "kl_coef", "episode")


class Recorder(pl.Callback):
    """Every logged value of every iteration."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(trainer.callback_metrics[k]) for k in KEYS})


# The critic in a param group of its own, at its own lr and clip (lightning_ppo.ppo.param_groups).
CRITIC_APART = {"critic_optimizer": partial(torch.optim.AdamW, lr=3e-3), "critic_max_grad_norm": 0.5}


def _fit(policy, root, iterations: int, ckpt_path=None, callbacks=(), limit=None, max_epochs=-1, critic=None):
    pl.seed_everything(0)
    critic = critic or {}
    module = PPOLightningModule(
        policy=str(policy),
        reward_fn=DigitsReward(),
        # adaptive KL and running score normalisation: state beyond the weights that must survive
        ppo=PPOConfig(
            ppo_epochs=EPOCHS,
            num_minibatches=MINIBATCHES,
            kl_coef=0.05,
            kl_target=0.5,
            score_norm=True,
            critic_max_grad_norm=critic.get("critic_max_grad_norm"),
        ),
        generation=GenerationConfig(max_new_tokens=6),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        critic_optimizer=critic.get("critic_optimizer"),
    )
    # 24 prompts / batch 8 = 3 iterations per epoch: the runs below cross epoch boundaries
    data = DigitsDataModule(num_prompts=24, num_digits=3, batch_size=8, max_prompt_length=8)
    recorder = Recorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=max_epochs,
        max_steps=iterations * EPOCHS * MINIBATCHES,
        limit_train_batches=limit,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[recorder, *callbacks],
        enable_checkpointing=bool(callbacks),
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, trainer, recorder.rows


# (iterations before the interruption, limit_train_batches): the checkpoint is written mid-epoch,
# at the last batch of an epoch cut short by limit_train_batches (2 of 3), and at the last batch of
# a full epoch (3 of 3). The interrupted run stops by max_steps, as a killed one would.
BOUNDARIES = {"mid-epoch": (4, None), "end-of-limited-epoch": (4, 2), "end-of-full-epoch": (3, None)}


@pytest.mark.parametrize("boundary", list(BOUNDARIES))
def test_resumed_run_equals_uninterrupted_run_bitwise(boundary, tiny_digits, tmp_path):
    stop, limit = BOUNDARIES[boundary]
    total = 2 * stop
    full, _, full_rows = _fit(tiny_digits, tmp_path / "full", iterations=total, limit=limit)
    saver = PPOCheckpoint(every_n_iterations=1, dirpath=tmp_path / "ckpt")
    _, _, half_rows = _fit(tiny_digits, tmp_path / "half", iterations=stop, callbacks=[saver], limit=limit)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    resumed, _, resumed_rows = _fit(
        tiny_digits, tmp_path / "resumed", iterations=total, ckpt_path=ckpt, limit=limit
    )

    assert resumed.iteration == full.iteration == total
    assert len(half_rows) == stop and half_rows + resumed_rows == full_rows
    for name, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert resumed.kl_ctl.value == full.kl_ctl.value
    assert resumed.score_moments.state_dict() == full.score_moments.state_dict()


def test_resume_with_the_critic_in_a_group_of_its_own_is_bitwise(tiny_digits, tmp_path):
    """Two param groups (each role's lr and clip): the optimizer state of both is saved and resumed."""
    full, _, full_rows = _fit(tiny_digits, tmp_path / "full", iterations=4, critic=CRITIC_APART)
    saver = PPOCheckpoint(every_n_iterations=1, dirpath=tmp_path / "ckpt")
    _fit(tiny_digits, tmp_path / "half", iterations=2, callbacks=[saver], critic=CRITIC_APART)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(ckpt, weights_only=True)["optimizer_states"][0]
    assert [g["lr"] for g in saved["param_groups"]] == [1e-3, 3e-3]
    resumed, _, resumed_rows = _fit(tiny_digits, tmp_path / "resumed", 4, ckpt_path=ckpt, critic=CRITIC_APART)
    assert resumed_rows == full_rows[2:]
    for name, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    state, again = full.optimizers().optimizer.state_dict(), resumed.optimizers().optimizer.state_dict()
    assert state["param_groups"] == again["param_groups"]
    assert all(
        torch.equal(state["state"][i][k], again["state"][i][k])
        for i in state["state"]
        for k in state["state"][i]
    )


def test_a_checkpoint_of_one_param_group_resumes_as_written_and_refuses_a_group_per_role(
    tiny_digits, tmp_path
):
    """A checkpoint written before the critic could have its own group (no such settings in it) resumes
    without them; with them, or the other way round, the optimizer state cannot fit: one line."""
    saver = PPOCheckpoint(every_n_iterations=1, dirpath=tmp_path / "ckpt")
    _fit(tiny_digits, tmp_path / "half", iterations=1, callbacks=[saver])
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    del ckpt["hyper_parameters"]["critic_optimizer"], ckpt["hyper_parameters"]["ppo"]["critic_max_grad_norm"]
    torch.save(ckpt, tmp_path / "before.ckpt")  # as a checkpoint of the package before these settings
    resumed, _, rows = _fit(
        tiny_digits, tmp_path / "resumed", iterations=2, ckpt_path=tmp_path / "before.ckpt"
    )
    assert resumed.iteration == 2 and len(rows) == 1
    for critic in (CRITIC_APART, {"critic_max_grad_norm": 1.0}):
        with pytest.raises(
            UsageError,
            match="^the checkpoint's optimizer has one param group for the policy and the critic together, ",
        ):
            _fit(tiny_digits, tmp_path / "apart", 2, ckpt_path=tmp_path / "before.ckpt", critic=critic)
    saver = PPOCheckpoint(every_n_iterations=1, dirpath=tmp_path / "ckpt_apart")
    _fit(tiny_digits, tmp_path / "split", iterations=1, callbacks=[saver], critic=CRITIC_APART)
    with pytest.raises(
        UsageError,
        match="^the checkpoint's optimizer has one for each of them, this run's one param group for",
    ):
        _fit(tiny_digits, tmp_path / "joined", 2, ckpt_path=tmp_path / "ckpt_apart" / "last.ckpt")


def test_resume_into_a_further_epoch_sees_every_batch(tiny_digits, tmp_path):
    """A run that ended with max_epochs, continued with a larger max_epochs: N epochs + N == 2N."""
    full, _, full_rows = _fit(tiny_digits, tmp_path / "full", iterations=100, limit=2, max_epochs=2)
    saver = PPOCheckpoint(every_n_iterations=1, dirpath=tmp_path / "ckpt")
    _, _, half_rows = _fit(tiny_digits, tmp_path / "half", 100, callbacks=[saver], limit=2, max_epochs=1)
    resumed, _, resumed_rows = _fit(
        tiny_digits, tmp_path / "resumed", 100, tmp_path / "ckpt" / "last.ckpt", limit=2, max_epochs=2
    )
    assert len(half_rows) == len(resumed_rows) == 2
    assert half_rows + resumed_rows == full_rows
    for name, value in full.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_checkpoint_every_n_iterations_writes_last_and_best(tiny_digits, tmp_path):
    callback = PPOCheckpoint(
        every_n_iterations=2, dirpath=tmp_path / "ckpt", monitor="objective/scores", mode="max", save_top_k=1
    )
    _fit(tiny_digits, tmp_path, iterations=4, callbacks=[callback])
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "last.ckpt" in names and len(names) == 2  # last + the best by score
    assert callback.best_model_score is not None
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert state["ppo_state"]["iteration"] == 4
    assert state["ppo_state"]["rng_states"].shape[0] == 1


def test_an_option_newer_than_the_checkpoint_left_at_its_default_is_no_change():
    """A checkpoint written before ``trust_remote_code`` and ``generation.server_max_in_flight``
    existed ran as their defaults do: resuming with them unset warns of nothing (it warned
    "None in the checkpoint, 256 now" for every older checkpoint); set otherwise, it is a change."""
    import warnings

    from lightning_ppo.module import PPOLightningModule, default_hparams
    from lightning_ppo.runs.resume import check_resumable

    defaults = default_hparams(PPOLightningModule)
    now = {**defaults, "policy": "p"}
    older = {key: value for key, value in now.items() if key != "trust_remote_code"}
    older["generation"] = {k: v for k, v in now["generation"].items() if k != "server_max_in_flight"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_resumable({"hyper_parameters": older}, now, {}, defaults)
    changed = {**now, "generation": {**now["generation"], "server_max_in_flight": 64}}
    with pytest.warns(UserWarning, match=r"server_max_in_flight: None in the checkpoint, 64 now"):
        check_resumable({"hyper_parameters": older}, changed, {}, defaults)


@pytest.mark.parametrize("scheduled", [False, True])
def test_a_learning_rate_changed_on_resume_is_the_checkpoints_and_said_once(scheduled, tiny_digits, tmp_path):
    """Lightning restores the optimizer state, its lr included (and a scheduler's base rate): the
    config's new rate was silently not used. It still is not (as in Lightning), but said in one line."""
    import warnings

    def fit(lr: float, epochs: int, ckpt_path=None) -> tuple[pl.Trainer, list[str]]:
        torch.manual_seed(0)
        module = PPOLightningModule(
            policy=str(tiny_digits),
            reward_fn=DigitsReward(),
            optimizer=partial(torch.optim.AdamW, lr=lr),
            lr_scheduler=partial(torch.optim.lr_scheduler.LinearLR, total_iters=100) if scheduled else None,
        )
        trainer = quiet_trainer(tmp_path, iterations=1, epochs=epochs)
        data = DigitsDataModule(num_prompts=32, batch_size=8, max_prompt_length=16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return trainer, [str(w.message) for w in caught if "init_args.lr: " in str(w.message)]

    first, said = fit(1e-3, epochs=1)
    assert said == []
    first.save_checkpoint(tmp_path / "one.ckpt")
    resumed, said = fit(5e-4, epochs=2, ckpt_path=tmp_path / "one.ckpt")
    assert len(said) == 1 and "\n" not in said[0]
    assert "model.optimizer.init_args.lr: 0.0005 in the config, 0.001 in the checkpoint" in said[0]
    group = resumed.optimizers[0].param_groups[0]
    assert group.get("initial_lr", group["lr"]) == 1e-3  # Lightning's behaviour, kept
    _, said = fit(1e-3, epochs=2, ckpt_path=tmp_path / "one.ckpt")
    assert said == []  # the same rate: nothing to say
