"""An optional config field set to null on the command line (``--model.init_args.ppo.kl_target null``),
which jsonargparse refused with ``expected float, got None`` (issue 42), and the nulls it must still
refuse or leave alone (a review's cases)."""

from __future__ import annotations

import pytest
import yaml

from lightning_ppo import PPOLightningModule
from lightning_ppo.cli import main
from lightning_ppo.runs.null_args import nulls_as_sections

PPO = "--model.init_args.ppo"


def test_a_null_optional_field_is_held_back_and_given_as_its_section():
    args = ["fit", f"{PPO}.kl_target", "null", f"{PPO}.ppo_epochs", "3", "--model.generation.stop_token=None"]
    args += ["--trainer.max_steps", "null", "--model.init_args.value", "null", f"{PPO}.ppo_epochs", "~"]
    assert nulls_as_sections(args, PPOLightningModule) == [
        "fit",
        f"{PPO}.ppo_epochs",
        "3",
        "--trainer.max_steps",  # not a config section's field: as given
        "null",
        "--model.init_args.value",
        "null",
        f"{PPO}.ppo_epochs",  # an int: as given, for jsonargparse to refuse
        "~",
        PPO,
        '{"kl_target": null}',
        "--model.init_args.generation",
        '{"stop_token": null}',
    ]


@pytest.mark.parametrize(
    "later",
    [[f"{PPO}.kl_target", "0.5"], ["--model.ppo.kl_target", "0.5"], [PPO, '{"kl_target": 0.5}']],
    ids=["same-key", "alias", "whole-section"],
)
def test_a_value_given_after_the_null_wins(later):
    given = nulls_as_sections(["fit", f"{PPO}.kl_target", "null", *later], PPOLightningModule)
    assert given[-2:] == later  # nothing held back comes after it


def _printed(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as exited:
        main(["fit", *args, "--print_config"])
    assert exited.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_the_cli_sets_optional_fields_to_null_and_keeps_their_sections_other_fields(capsys):
    printed = _printed(
        capsys,
        "--config",
        "configs/gsm8k_ppo.yaml",
        f"{PPO}.micro_batch_tokens",
        "null",
        f"{PPO}.ppo_epochs",
        "2",
        "--model.ppo.kl_target=null",
    )
    ppo = printed["model"]["init_args"]["ppo"]
    assert ppo["micro_batch_tokens"] is None and ppo["kl_target"] is None  # 8192 in the file
    assert ppo["ppo_epochs"] == 2 and ppo["kl_coef"] == 0.001 and ppo["num_minibatches"] == 4


def test_a_config_given_after_a_null_overrides_it_as_it_would_any_value(capsys, tmp_path):
    config = tmp_path / "later.yaml"
    config.write_text(yaml.safe_dump({"model": {"init_args": {"ppo": {"kl_target": 0.25}}}}))
    printed = _printed(
        capsys, "--config", "configs/quickstart.yaml", f"{PPO}.kl_target", "null", "--config", str(config)
    )
    assert printed["model"]["init_args"]["ppo"]["kl_target"] == 0.25


def test_other_nulls_reach_jsonargparse_as_given(capsys):
    printed = _printed(capsys, "--config", "configs/quickstart.yaml", "--trainer.callbacks.max_rows", "null")
    assert [c for c in printed["trainer"]["callbacks"] if c["class_path"].endswith("SampleTable")]
    with pytest.raises(SystemExit) as refused:  # an int field: refused, naming it, as before
        main(["fit", "--config", "configs/quickstart.yaml", f"{PPO}.ppo_epochs", "null", "--print_config"])
    assert refused.value.code == 2
    assert "model.init_args.ppo.ppo_epochs: expected int, got None" in capsys.readouterr().err
