"""The selfcheck's :class:`~lightning_ppo.selfcheck.recorder.SamplingRecorder` given to a second fit
in one process (a notebook that fits again with the same callback)."""

from __future__ import annotations

import functools

import torch

from lightning_ppo import PPOLightningModule
from lightning_ppo.config import GenerationConfig, PPOConfig
from lightning_ppo.selfcheck.recorder import SamplingRecorder
from lightning_ppo.selfcheck.task import PromptCharReward, SelfcheckPrompts, SelfcheckTask
from tests.helpers import quiet_trainer

ITERATIONS = 3


def _fitted(task: SelfcheckTask, root, lr: float, recorders: list[SamplingRecorder]) -> None:
    """A fresh module on the selfcheck task trained ``ITERATIONS`` iterations at ``lr``."""
    module = PPOLightningModule(
        policy=str(task.checkpoint(root)),
        reward_fn=PromptCharReward(length=task.max_new_tokens, offsets=dict(task.offsets)),
        ppo=PPOConfig(kl_coef=task.beta, missing_eos_penalty=None),
        generation=GenerationConfig(
            max_new_tokens=task.max_new_tokens, temperature=1.0, suppress_tokens=task.suppressed()
        ),
        optimizer=functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.0),
    )
    data = SelfcheckPrompts(list(task.prompts), ITERATIONS, batch_size=8, max_prompt_length=8)
    quiet_trainer(root, iterations=ITERATIONS, callbacks=recorders).fit(module, datamodule=data)


def test_a_recorder_given_to_a_second_fit_scores_it_against_its_own_versions(tmp_path):
    """Before, the second fit's versions 1 and 2 were found among the first fit's (another policy,
    trained at another rate) and kept: its batches 1 and 2 were scored against them, terms unlike
    those a fresh recorder takes of the same fit."""
    task = SelfcheckTask()
    again = SamplingRecorder(list(task.prompts))
    _fitted(task, tmp_path, lr=3e-2, recorders=[again])
    fresh = SamplingRecorder(list(task.prompts))
    _fitted(task, tmp_path, lr=3e-3, recorders=[again, fresh])
    assert fresh.terms[1:].abs().sum() > 0  # batches 1 and 2 scored (the first: nothing older)
    assert torch.equal(again.terms, fresh.terms)
    assert again.check().z == fresh.check().z
