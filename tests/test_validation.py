"""Bad configs fail before any model is loaded: exit status 2 and one line that names the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.cli import main
from lightning_ppo.tasks.tiny import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
NO_MODEL = "/nonexistent/policy"  # loading it would fail with another error: these must fail first


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--model.init_args.ppo.gamma", "1.5"], "ppo.gamma must be in \\[0, 1\\], got 1.5"),
        (["--model.init_args.ppo.gae_lambda", "-0.1"], "ppo.gae_lambda must be in \\[0, 1\\]"),
        (["--model.init_args.ppo.clip_range", "0"], "ppo.clip_range must be > 0"),
        (["--model.init_args.ppo.value_clip_range", "-1"], "ppo.value_clip_range must be > 0"),
        (["--model.init_args.generation.max_new_tokens", "0"], "generation.max_new_tokens must be >= 1"),
        (["--model.init_args.ppo.advantage_estimator", "ppo2"], "ppo.advantage_estimator must be one of"),
        (["--model.init_args.ppo.kl_estimator", "k4"], "ppo.kl_estimator must be one of"),
        (
            ["--data.init_args.batch_size", "7"],
            "the rollout batch \\(data.batch_size 7 .* must divide into ppo.num_minibatches",
        ),
    ],
)
def test_bad_config_fails_before_loading_models(override, message, capsys):
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--model.init_args.policy",
        NO_MODEL,
    ]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, *override])
    assert exit_info.value.code == 2
    assert re.search(f"^lightning-ppo: error: {message}", capsys.readouterr().err, re.MULTILINE)


def test_stop_token_outside_the_vocabulary_fails_before_loading_weights(tmp_path):
    build_char_tokenizer("0123456789=").save_pretrained(tmp_path)  # a tokenizer, no model weights
    with pytest.raises(ValueError, match="generation.stop_token '<end>' is not a single token"):
        PPOLightningModule(
            policy=str(tmp_path),
            reward_fn=lambda p, c, b: [0.0] * len(c),
            generation=GenerationConfig(stop_token="<end>"),
        )


def test_group_estimators_need_groups():
    with pytest.raises(ValueError, match="ppo.num_generations must be >= 2 with advantage_estimator 'grpo'"):
        PPOConfig(advantage_estimator="grpo")


def test_gpu_configs_parse():
    for config in sorted((ROOT / "configs" / "gpu").glob("*.yaml")):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(config), "--print_config"])
        assert exit_info.value.code == 0, config
