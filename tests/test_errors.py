"""User mistakes end in one line naming the field, file or path (exit status 2), not a traceback."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule, PromptDataModule
from lightning_ppo.cli import main
from lightning_ppo.rewards import RewardModel
from lightning_ppo.runs.errors import TRACEBACK_ENV, UsageError
from lightning_ppo.runs.preflight import check_checkpoint_file
from lightning_ppo.runs.run_length import check_step_limit
from lightning_ppo.tasks.tiny import (
    DEFAULT_ALPHABET,
    TinyModelSpec,
    build_char_tokenizer,
    make_tiny_checkpoint,
)
from tests.helpers import (
    CountCharReward,
    cli_usage_error,
    forked_cli_process,
    one_line_error,
    prompt_data,
    quiet_trainer,
    saver,
)

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
NO_MODEL = "/nonexistent/policy"


def _usage_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    """Run ``fit --config QUICKSTART ARGS`` in-process; returns its one error line (status 2)."""
    return "lightning-ppo: error: " + cli_usage_error(capsys, ["fit", "--config", QUICKSTART, *args])


def _fit_args(tmp_path: Path, policy: Path, *extra: str) -> list[str]:
    """The quickstart, one short iteration of it, on ``policy``, writing only under ``tmp_path``."""
    return [
        "--model.init_args.policy",
        str(policy),
        "--trainer.limit_train_batches",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.logger",
        "false",
        "--trainer.callbacks",
        "[]",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--data.init_args.num_prompts",
        "16",
        "--data.init_args.num_val_prompts",
        "0",
        "--data.init_args.batch_size",
        "8",
        *extra,
    ]


# ----------------------------------------------------------------- reporting


def test_bad_value_from_the_console_is_one_line_and_status_2():
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop(TRACEBACK_ENV, None)
    args = ["fit", "--config", "configs/quickstart.yaml", "--model.init_args.ppo.gamma", "1.5"]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_ppo.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) <= 2 and "ppo.gamma must be in [0, 1], got 1.5" in lines[-1], done.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model.init_args.ppo.gamma", "abc"], "model.init_args.ppo.gamma: expected float, got abc"),
        (["--model.init_args.ppo.gama", "0.5"], "model.init_args: unrecognized arguments: --ppo.gama"),
        (["--trainer.max_epochs", "abc"], "trainer.max_epochs: expected int, got abc"),
        (["--config", "/nonexistent/run.yaml"], "config: File does not exist: '/nonexistent/run.yaml'"),
    ],
)
def test_parser_errors_name_the_key_without_usage_or_config_dump(args, expected, capsys):
    line = _usage_error(capsys, *args)
    assert expected in line
    assert "Given value" not in line and "Namespace(" not in line


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        (
            "command line",
            "model.init_args: unrecognized arguments: --ppo.kl_coeff=0.1; did you mean ppo.kl_coef?",
        ),
        ("yaml", "model.init_args: Group 'ppo' does not accept option 'kl_coeff'; did you mean kl_coef?"),
        (
            "trainer",
            "Subcommand 'fit' does not accept option 'trainer.max_step'; did you mean trainer.max_steps?",
        ),
        ("class_path", "data.init_args: Option 'batch_sise' is not accepted; did you mean batch_size?"),
    ],
)
def test_a_misspelt_key_gets_the_closest_valid_one(where, expected, tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text(
        {
            "yaml": "model: {init_args: {ppo: {kl_coeff: 0.1}}}",
            "trainer": "trainer: {max_step: 3}",
            "class_path": "data: {init_args: {batch_sise: 3}}",
        }.get(where, "{}")
    )
    args = ["--model.init_args.ppo.kl_coeff", "0.1"] if where == "command line" else ["--config", str(typo)]
    done = forked_cli_process(["fit", "--config", QUICKSTART, "--model.init_args.policy", NO_MODEL, *args])
    assert one_line_error(done) == expected
    assert len(done.stderr.strip().splitlines()) == 1


def test_traceback_variable_lets_the_usage_error_through(monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(UsageError, match="ppo.gamma must be in"):
        main(["fit", "--config", QUICKSTART, "--model.init_args.ppo.gamma", "1.5"])


def test_error_raised_while_building_the_datamodule_is_unwrapped(tiny_digits, tmp_path, capsys):
    # jsonargparse wraps errors of __init__ in a report that dumps the whole model section.
    line = _usage_error(capsys, *_fit_args(tmp_path, tiny_digits, "--data.init_args.batch_size", "0"))
    assert line.endswith("error: data.batch_size must be at least 1, got 0")


def test_a_suppress_tokens_pattern_matching_no_token_is_one_line(tiny_digits, tmp_path, capsys):
    # the digits vocabulary holds no "[unused...]" token ("[" is literal, not fnmatch's character class)
    args = _fit_args(tmp_path, tiny_digits, "--model.init_args.generation.suppress_tokens", '["[unused*]"]')
    line = _usage_error(capsys, *args)
    assert line.endswith(
        "error: generation.suppress_tokens: pattern '[unused*]' matches no token of the "
        "tokenizer's vocabulary"
    )


def _fit_process(tmp_path: Path, policy: Path, *extra: str) -> subprocess.CompletedProcess:
    """``lightning-ppo fit`` of :func:`_fit_args` in a process of its own (forked, see start_forked)."""
    return forked_cli_process(["fit", "--config", QUICKSTART, *_fit_args(tmp_path, policy, *extra)])


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ("--model.init_args.reward_fn", "tests.helpers.one_score_short"),
            "reward 'one_score_short' must return one score per completion, shape (8,), got shape (7,)",
        ),
        (
            ("--model.init_args.reward_fn", "tests.helpers.two_argument_reward"),
            "model.reward_fn 'two_argument_reward' has the signature two_argument_reward(prompts, "
            "completions), which fits neither way a reward is called: fn(prompts, completions, batch)",
        ),
        (
            ("--model.init_args.generation.suppress_tokens", '["x"]'),
            "generation.suppress_tokens: 'x' is not a single token of the tokenizer's vocabulary",
        ),
        (
            ("--model.init_args.generation.suppress_tokens", "[99]"),
            "generation.suppress_tokens: id 99 is outside the tokenizer's 14 tokens",
        ),
        (
            ("--model.init_args.reward_fn", "tests.helpers.one_score_shrt"),
            "model.reward_fn 'tests.helpers.one_score_shrt' is neither a reward model's folder nor an "
            "importable function (module 'tests.helpers' has no attribute 'one_score_shrt')",
        ),
    ],
    ids=["reward-shape-first-rollout", "reward-signature", "suppress-unknown", "suppress-id", "import-path"],
)
def test_mistakes_found_building_the_module_or_in_the_first_rollout_are_one_line(
    args, expected, tiny_digits, tmp_path
):
    # jsonargparse wraps what __init__ raises, Lightning re-raises what training raises: both used to
    # reach the console as 55-90-line tracebacks with exit status 1.
    assert one_line_error(_fit_process(tmp_path, tiny_digits, *args)).startswith(expected)


@pytest.mark.parametrize(
    ("args", "package", "expected"),
    [
        (
            ("--model.init_args.generation.engine", "vllm"),
            "vllm",
            "generation.engine 'vllm' needs the vllm package, which is not installed: pip install",
        ),
        (
            ("--trainer.strategy", "deepspeed"),
            "deepspeed",
            "trainer.strategy 'deepspeed' needs the deepspeed package, which is not installed: pip install",
        ),
        (
            ("--config", str(ROOT / "configs" / "gpu" / "deepspeed_zero2.yaml")),
            "deepspeed",
            "trainer.strategy 'DeepSpeedStrategy' needs the deepspeed package, which is not installed",
        ),
    ],
    ids=["vllm-engine", "strategy-name", "strategy-class-path"],
)
def test_a_missing_engine_or_strategy_package_fails_before_any_model_loads(args, package, expected):
    if find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    # The policy does not exist: the package is checked before the model paths, long before loading.
    done = forked_cli_process(["fit", "--config", QUICKSTART, *args, "--model.init_args.policy", NO_MODEL])
    assert one_line_error(done).startswith(expected)
    assert len(done.stderr.strip().splitlines()) <= 2  # "Seed set to 0" and the error


@pytest.mark.parametrize("stop", ["eos-by-id", "stop-token-by-text"])
def test_suppressing_the_stop_token_is_refused_naming_both_fields(stop, tiny_digits, tmp_path):
    # Accepted silently before: no response could end (response/eos_fraction 0.0 every iteration).
    if stop == "eos-by-id":
        eos = AutoTokenizer.from_pretrained(tiny_digits).eos_token_id
        args = ("--model.init_args.generation.suppress_tokens", f"[{eos}]")
        shown = f"{eos} is the stop token (generation.stop_token null: the tokenizer's EOS '<eos>', id {eos})"
    else:
        args = ("--model.init_args.generation.suppress_tokens", '["="]')
        args += ("--model.init_args.generation.stop_token", "=")
        shown = "'=' is the stop token (generation.stop_token '=', id "
    line = one_line_error(_fit_process(tmp_path, tiny_digits, *args))
    assert line.startswith(f"generation.suppress_tokens: {shown}")
    assert line.endswith("remove it from generation.suppress_tokens or set another generation.stop_token")


# ----------------------------------------------------------------- run length


def test_max_steps_is_said_in_iterations_and_one_that_would_be_overshot_is_refused(tiny_digits, tmp_path):
    # 1 epoch x 2 minibatches = 2 optimizer steps per iteration; max_steps 3 used to run 2 iterations (4).
    steps = ("--model.init_args.ppo.ppo_epochs", "1", "--trainer.limit_train_batches", "5")
    line = one_line_error(_fit_process(tmp_path, tiny_digits, *steps, "--trainer.max_steps", "3"))
    assert line == (
        "trainer.max_steps 3 counts optimizer steps, 2 per PPO iteration (ppo.ppo_epochs 1 x "
        "ppo.num_minibatches 2), and is checked between iterations: the run would stop after 4; use a "
        "multiple of 2 (2, 4), or set the length in iterations with trainer.limit_train_batches and "
        "trainer.max_epochs"
    )
    done = _fit_process(tmp_path, tiny_digits, *steps, "--trainer.max_steps", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    said = "lightning_ppo: trainer.max_steps 4 = 2 PPO iterations of 2 optimizer steps "
    assert (done.stdout + done.stderr).count(said + "(ppo.ppo_epochs 1 x ppo.num_minibatches 2)") == 1
    assert "`max_steps=4` reached" in done.stdout + done.stderr


def test_a_last_batch_that_cannot_be_split_is_refused_before_training(tiny_digits, tmp_path):
    # 18 prompts in batches of 8 leave 2, which 4 minibatches cannot split: this used to fail at the end
    # of the epoch, naming "data.batch_size 2".
    args = ("--data.init_args.drop_last", "false", "--data.init_args.num_prompts", "18")
    args += ("--model.init_args.ppo.num_minibatches", "4", "--trainer.limit_train_batches", "5")
    counter = {"class_path": "tests.helpers.Throttle", "init_args": {"seconds": 0.0, "progress_file": "done"}}
    counter["init_args"]["progress_file"] = str(tmp_path / "done")  # written after every iteration
    args += ("--trainer.callbacks", json.dumps([counter]))
    line = one_line_error(_fit_process(tmp_path, tiny_digits, *args))
    assert line == (
        "data.drop_last is false and the train set's 18 prompts in batches of data.batch_size 8 leave a "
        "last batch of 2, which does not divide into ppo.num_minibatches x ppo.gradient_accumulation_steps "
        "= 4 x 1 = 4 equal parts: set data.drop_last: true, or another data.batch_size"
    )
    assert not (tmp_path / "done").exists()  # before the first iteration


def test_a_resumed_run_counts_max_steps_from_the_checkpoints_steps():
    # 4 iterations of 8 steps saved, then resumed with 4 minibatches: 16 steps per iteration from step 32.
    ppo = PPOConfig(ppo_epochs=4, num_minibatches=4)
    with pytest.raises(UsageError, match=r"stop after 48; use 32 \(the checkpoint's steps\) plus a multiple"):
        check_step_limit(40, ppo, done=32)
    assert check_step_limit(48, ppo, done=32) == (
        "trainer.max_steps 48 = the checkpoint's 32 steps + 1 PPO iteration of 16 optimizer steps "
        "(ppo.ppo_epochs 4 x ppo.num_minibatches 4)"
    )
    assert check_step_limit(32, ppo, done=32) is None  # nothing left: said after fit (explain_idle_resume)


def test_resuming_a_finished_run_that_trains_nothing_says_why(tiny_digits, tmp_path):
    saving = ("--trainer.callbacks", json.dumps([saver(every_n_iterations=1)]))
    saving += ("--trainer.enable_checkpointing", "true", "--model.init_args.ppo.ppo_epochs", "1")
    first = _fit_process(tmp_path, tiny_digits, *saving, "--trainer.limit_train_batches", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    last = tmp_path / "checkpoints" / "last.ckpt"
    saved = last.read_bytes()
    # A larger limit_train_batches does not reopen the epoch the first run finished: 0 iterations,
    # which used to pass in silence.
    args = (*saving, "--trainer.limit_train_batches", "4", "--ckpt_path", "last")
    resumed = _fit_process(tmp_path, tiny_digits, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = [line for line in resumed.stderr.splitlines() if "nothing trained" in line]
    assert len(said) == 1 and said[0].endswith(
        f"nothing trained: resumed from {last} at iteration 2, the checkpoint's run had finished 1 of "
        "trainer.max_epochs 1 epochs (an epoch cut short by trainer.limit_train_batches counts as finished: "
        "a larger limit_train_batches does not reopen it): raise trainer.max_epochs to train more"
    )
    assert last.read_bytes() == saved


# ----------------------------------------------------------------- paths, positions, checkpoints


@pytest.mark.parametrize("field", ["policy", "reward_model", "tokenizer"])
def test_missing_model_or_tokenizer_folder_is_named(field, tiny_digits, tmp_path, capsys):
    missing = str(tmp_path / "not-there")
    line = _usage_error(
        capsys, "--model.init_args.policy", str(tiny_digits), f"--model.init_args.{field}", missing
    )
    assert line.endswith(
        f"model.{field}: {'tokenizer' if field == 'tokenizer' else 'model'} folder {missing!r} does not exist"
    )


def test_folder_without_config_json_holds_no_model(tiny_digits, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _usage_error(
        capsys, "--model.init_args.policy", str(tiny_digits), "--model.init_args.reward_model", str(empty)
    )
    assert line.endswith(f"model.reward_model: folder {str(empty)!r} holds no model (no config.json in it)")
    line = _usage_error(
        capsys, "--model.init_args.policy", str(tiny_digits), "--model.init_args.tokenizer", str(empty)
    )
    assert f"model.tokenizer: folder {str(empty)!r} holds no tokenizer" in line


def test_a_reward_model_without_a_scoring_head_is_refused(tiny_digits, tmp_path):
    # The policy's own folder, a causal LM: loaded as a classifier it used to train with a random head.
    args = ("--model.init_args.reward_model", str(tiny_digits))
    line = one_line_error(_fit_process(tmp_path, tiny_digits, *args))
    assert line == (
        f"model.reward_model: {str(tiny_digits)!r} has no scoring head in its weights (no score.* or "
        "classifier.* tensor; a causal LM?): a reward model is a checkpoint of "
        "AutoModelForSequenceClassification with num_labels=1"
    )
    # Loading checks too (hub names and other weight formats skip the check of the files).
    with pytest.raises(UsageError, match=r"has no scoring head in its weights \(score.weight missing;"):
        RewardModel.from_pretrained(str(tiny_digits))


def test_prompt_plus_response_past_the_positions_fails_before_loading(tiny_digits, capsys):
    # tiny_digits has 128 positions (GPT-2's n_positions)
    args = ["--model.init_args.policy", str(tiny_digits), "--data.init_args.max_prompt_length", "100"]
    line = _usage_error(capsys, *args, "--model.init_args.generation.max_new_tokens", "40")
    assert "data.max_prompt_length (100) + model.generation.max_new_tokens (40) = 140 tokens" in line
    assert "more than the 128 positions of model.policy" in line and "(n_positions in its config)" in line


@pytest.fixture(scope="module")
def short_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama (rotary positions) declaring only 16 positions (max_position_embeddings)."""
    spec = TinyModelSpec(arch="llama", n_layer=1, n_embd=32, n_positions=16)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("short_llama"), spec)


def test_python_api_checks_positions_in_setup(short_llama, tmp_path):
    module = PPOLightningModule(
        policy=str(short_llama), reward_fn=CountCharReward(), generation=GenerationConfig(max_new_tokens=12)
    )
    trainer = quiet_trainer(tmp_path, iterations=1)
    with pytest.raises(
        UsageError, match=r"max_prompt_length \(8\) .* = 20 tokens, more than the 16 positions"
    ):
        trainer.fit(module, datamodule=prompt_data())  # prompts of at most 8 tokens


@pytest.mark.parametrize(
    ("damage", "reason"),
    [("random bytes", "it is not a file written by torch.save"), ("truncated", "its archive is damaged")],
)
def test_unreadable_checkpoint_is_named(damage, reason, tmp_path, capsys):
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.randn(256, 256)}, "epoch": 3}, ckpt)
    data = ckpt.read_bytes()
    ckpt.write_bytes(random.Random(0).randbytes(4096) if damage == "random bytes" else data[: len(data) // 2])
    line = _usage_error(capsys, "--model.init_args.policy", NO_MODEL, "--ckpt_path", str(ckpt))
    assert f"ckpt_path: {str(ckpt)!r} is not a readable checkpoint: {reason}" in line


def test_missing_checkpoint_is_named(tmp_path, capsys):
    gone = str(tmp_path / "gone.ckpt")
    line = _usage_error(capsys, "--model.init_args.policy", NO_MODEL, "--ckpt_path", gone)
    assert line.endswith(f"ckpt_path: {gone!r} does not exist")


def test_export_of_an_unreadable_or_missing_checkpoint_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(os.urandom(1024))
    gone = tmp_path / "gone.ckpt"
    for path, expected in [
        (bad, "is not a readable checkpoint: it is not a file written by torch.save"),
        (gone, "does not exist"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["export", str(path), "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == f"lightning-ppo: error: checkpoint: {str(path)!r} {expected}\n"


def test_checkpoint_written_by_the_trainer_passes_the_check(tiny_digits, tmp_path):
    module = PPOLightningModule(
        policy=str(tiny_digits),
        reward_fn=CountCharReward(),
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=2),
    )
    trainer = quiet_trainer(tmp_path, iterations=1)
    trainer.fit(module, datamodule=prompt_data())
    trainer.save_checkpoint(tmp_path / "good.ckpt")
    check_checkpoint_file(str(tmp_path / "good.ckpt"))


# ----------------------------------------------------------------- data files and prompts


@pytest.fixture
def digits_tokenizer(tmp_path: Path) -> str:
    path = tmp_path / "digits_tok"
    build_char_tokenizer("0123456789=").save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """Keep the Arrow files `datasets` writes for local files out of the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


def _setup_data(tokenizer: str, data_file: Path) -> None:
    PromptDataModule(tokenizer=tokenizer, data_files=str(data_file), batch_size=1).setup("fit")


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("p.jsonl", '{"prompt": "12="}\n{"prompt": "34=",}\n', "is not valid JSON Lines: line 2: Expecting"),
        ("p.jsonl", '{"prompt": "12="}\n"34="\n', "is not valid JSON Lines: line 2: expected a JSON object"),
        ("p.json", '[{"prompt": "12="}', "is not valid JSON: line 1: Expecting ',' delimiter"),
        ("p.csv", "prompt,answer\n12=,3\n34=,7,9\n", "is not valid CSV: Error tokenizing data"),
        ("p.parquet", "not a parquet file", "is not a readable Parquet file: Parquet magic bytes not found"),
    ],
    ids=["jsonl-syntax", "jsonl-not-an-object", "json-unclosed", "csv-extra-field", "parquet-garbage"],
)
def test_data_file_that_does_not_parse_is_named(name, content, expected, digits_tokenizer, tmp_path):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UsageError, match=f"^data file {str(path)!r} {expected}"):
        _setup_data(digits_tokenizer, path)


@pytest.mark.parametrize(
    ("name", "content"),
    [("p.jsonl", ""), ("p.jsonl", "\n\n"), ("p.csv", "prompt\n"), ("p.json", "[]")],
    ids=["empty-jsonl", "blank-lines-jsonl", "csv-header-only", "json-empty-array"],
)
def test_data_file_without_rows_is_named(name, content, digits_tokenizer, tmp_path):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UsageError, match=f"^data file {str(path)!r} has no rows$"):
        _setup_data(digits_tokenizer, path)


def test_data_file_error_reaches_the_command_line(tiny_digits, tmp_path, capsys):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    data = json.dumps(
        {"class_path": "lightning_ppo.PromptDataModule", "init_args": {"data_files": str(empty)}}
    )
    line = _usage_error(capsys, *_fit_args(tmp_path, tiny_digits), "--data", data)
    assert line.endswith(f"error: data file {str(empty)!r} has no rows")


@pytest.mark.parametrize(
    ("alphabet", "prompt", "char"), [("0123456789=", "1x2=", "x"), (DEFAULT_ALPHABET, "café", "é")]
)
def test_prompt_the_tokenizer_cannot_represent_names_its_row(alphabet, prompt, char, tmp_path):
    # The char-level tokenizers read an unknown character as EOS, silently; refused instead.
    build_char_tokenizer(alphabet).save_pretrained(tmp_path / "tok")
    data = PromptDataModule(
        tokenizer=str(tmp_path / "tok"), prompts=["12=", "", prompt, prompt], batch_size=1
    )
    with pytest.raises(
        UsageError,
        match=rf"^row 3 of data.prompts: prompt '{prompt}' has characters .* \('{char}'\), .* \(2 of 3 train",
    ):
        data.setup("fit")


# ----------------------------------------------------------------- optimizer


def test_optimizer_value_out_of_range_names_model_optimizer(tiny_digits, tmp_path, capsys):
    # torch checks the learning rate only when the optimizer is built, inside trainer.fit.
    line = _usage_error(
        capsys, *_fit_args(tmp_path, tiny_digits), "--model.init_args.optimizer.init_args.lr=-1"
    )
    assert line.endswith("error: model.optimizer: Invalid learning rate: -1.0")
