"""A nested config field set to null on the command line (``--model.init_args.ppo.kl_target null``),
which jsonargparse refused with ``expected float, got None`` (issue 42)."""

from __future__ import annotations

import pytest
import yaml

from lightning_ppo.cli import main
from lightning_ppo.runs.null_args import nulls_as_sections


def test_a_null_nested_field_moves_to_the_end_as_its_section_and_the_last_value_wins():
    args = ["fit", "--model.init_args.ppo.kl_target", "null", "--model.init_args.ppo.ppo_epochs", "3"]
    args += ["--model.generation.stop_token=None", "--trainer.max_steps", "null"]
    args += [
        "--model.init_args.value",
        "null",
        "--model.init_args.ppo.vf_coef=~",
        "--model.init_args.ppo.vf_coef",
        "1",
    ]
    assert nulls_as_sections(args) == [
        "fit",
        "--model.init_args.ppo.ppo_epochs",
        "3",
        "--trainer.max_steps",  # a group's own field: as given
        "null",
        "--model.init_args.value",  # a class's init argument: as given
        "null",
        "--model.init_args.ppo.vf_coef",  # set again after its null: the later value, no null
        "1",
        "--model.init_args.ppo",
        '{"kl_target": null}',
        "--model.generation",
        '{"stop_token": null}',
    ]


def test_the_cli_sets_a_nested_field_to_null_and_keeps_its_sections_other_fields(capsys):
    args = ["fit", "--config", "configs/gsm8k_ppo.yaml", "--model.init_args.ppo.micro_batch_tokens", "null"]
    args += ["--model.init_args.ppo.ppo_epochs", "2", "--model.ppo.kl_target=null", "--print_config"]
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code in (0, None)
    ppo = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["ppo"]
    assert ppo["micro_batch_tokens"] is None and ppo["kl_target"] is None  # 8192 in the file
    assert ppo["ppo_epochs"] == 2 and ppo["kl_coef"] == 0.001 and ppo["num_minibatches"] == 4
