"""configs/trl_ppo.yaml, TRL's examples/scripts/ppo/ppo.py setup, runs as docs/trl.md says."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_ppo.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_the_trl_ppo_example_config_runs_with_trls_hyper_parameters(tiny_digits, tiny_reward, tmp_path):
    cli = main(
        [
            *("fit", "--config", str(ROOT / "configs" / "trl_ppo.yaml")),
            *(
                "--model.init_args.policy",
                str(tiny_digits),
                "--model.init_args.reward_model",
                str(tiny_reward),
            ),
            *("--trainer.limit_train_batches", "2", "--trainer.default_root_dir", str(tmp_path)),
            *("--trainer.logger", "false", "--trainer.enable_progress_bar", "false"),
            *("--trainer.callbacks", json.dumps([]), "--trainer.enable_checkpointing", "false"),
            *("--data.init_args.batch_size", "8"),
        ]
    )
    module = cli.model
    assert module.iteration == 2
    assert module.ppo.num_minibatches == 1 and module.ppo.missing_eos_penalty == 1.0
    assert module.generation_config.max_new_tokens == 53 and module.generation_config.temperature == 0.7
    assert module.optimizers().param_groups[0]["lr"] == 3e-6
    # the critic starts from the reward checkpoint, as TRL's script builds its value model
    critic = module.roles.value_model.backbone.config
    assert critic.name_or_path == str(tiny_reward) and module.hparams.reward_model == str(tiny_reward)
