"""configs/gsm8k_ppo.yaml and configs/gsm8k_grpo.yaml through the CLI, in-process and offline: a tiny
Qwen2 with a Qwen-style chat template built here stands in for Qwen2.5-0.5B-Instruct, and a few dozen
rows in GSM8K's own format (question, worked answer ending ``#### N``, parquet files laid out as the
hub's ``main/train-*.parquet``) for ``openai/gsm8k``. The reward must get each question's own answer;
validation logs greedy pass@1 as ``eval/accuracy``; ``lightning-ppo validate --ckpt_path`` prints it."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pandas as pd
import pytest
import yaml

from lightning_ppo.cli import main
from lightning_ppo.tasks.math_answer import BOXED_INSTRUCTION, MathAnswerReward, final_answer
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from tests.helpers import cli_usage_error

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {name: ROOT / "configs" / f"gsm8k_{name}.yaml" for name in ("ppo", "grpo")}
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"  # printable ASCII and the newline


class RecordingMathReward(MathAnswerReward):
    """The configs' reward, keeping what each call received and returned."""

    calls: list[dict] = []

    def __call__(self, prompts, completions, **columns):
        scores = super().__call__(prompts, completions, **columns)
        entry = {
            "prompts": list(prompts),
            "answers": list(columns["answer"]),
            "completions": list(completions),
        }
        RecordingMathReward.calls.append({**entry, "scores": list(scores)})
        return scores


def gsm8k_rows(count: int, seed: int) -> list[dict[str, str]]:
    """Questions and worked answers written as GSM8K writes them (``<<a+b=c>>`` calculator notes, a
    last line ``#### N``), numbers drawn at random; each question is unique."""
    rng, rows, seen = random.Random(seed), [], set()
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Randy"]
    while len(rows) < count:
        name, kind = rng.choice(names), rng.randrange(3)
        if kind == 0:
            a = 2 * rng.randint(5, 60)
            half, total = a // 2, a + a // 2
            question = (
                f"{name} sold clips to {a} of her friends in April, and then she sold half as many clips to "
                f"her friends in May. How many clips did {name} sell altogether in April and May?"
            )
            answer = (
                f"{name} sold {a}/2 = <<{a}/2={half}>>{half} clips in May.\n"
                f"{name} sold {a}+{half} = <<{a}+{half}={total}>>{total} clips altogether in April and May.\n"
                f"#### {total}"
            )
        elif kind == 1:
            a, b, c = rng.randint(1, 30), rng.randint(2, 9), rng.randint(2, 12)
            total = a + b * c
            question = (
                f"{name} has {a} apples and buys {b} bags with {c} apples in each bag. "
                f"How many apples does {name} have now?"
            )
            answer = (
                f"The bags hold {b} * {c} = <<{b}*{c}={b * c}>>{b * c} apples.\n"
                f"{name} has {a} + {b * c} = <<{a}+{b * c}={total}>>{total} apples now.\n#### {total}"
            )
        else:
            a, b = 100 * rng.randint(6, 40), 100 * rng.randint(6, 40)
            question = (
                f"A school raised ${a} on Monday and ${b} on Tuesday for {name}'s trip. "
                "How many dollars did it raise in all?"
            )
            answer = f"It raised {a} + {b} = <<{a}+{b}={a + b}>>{a + b} dollars.\n#### {a + b:,}"
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": answer})
    return rows


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory) -> tuple[dict[str, str], dict[str, str]]:
    """Train and test files as the hub holds ``openai/gsm8k`` (``main/{split}-00000-of-00001.parquet``),
    and every question's answer."""
    folder = tmp_path_factory.mktemp("gsm8k") / "main"
    folder.mkdir()
    rows = gsm8k_rows(36, seed=0)
    files = {}
    for split, part in (("train", rows[:24]), ("test", rows[24:])):
        files[split] = str(folder / f"{split}-00000-of-00001.parquet")
        pd.DataFrame(part).to_parquet(files[split])
    return files, {row["question"]: row["answer"] for row in rows}


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> Path:
    """A 2 x 64 Qwen2 over printable ASCII with a Qwen-style chat template, saved and loaded by path."""
    from transformers import AutoTokenizer

    spec = TinyModelSpec(arch="qwen2", n_layer=2, n_embd=64, n_head=4, n_positions=1024)
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen"), spec, alphabet=ALPHABET)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def offline_args(config: Path, policy: Path, files: dict[str, str], root: Path, *extra: str) -> list[str]:
    """The shipped config on this machine: the tiny model, the local files, the CPU, short responses."""
    logger = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root)}}]
    return [
        "--config",
        str(config),
        "--trainer.accelerator",
        "cpu",
        "--trainer.default_root_dir",
        str(root),
        "--trainer.logger",
        json.dumps(logger),
        "--trainer.enable_progress_bar",
        "false",
        "--model.init_args.policy",
        str(policy),
        "--model.init_args.reward_fn",
        json.dumps(
            {"class_path": "tests.test_gsm8k.RecordingMathReward", "init_args": {"answer_column": "answer"}}
        ),
        "--model.init_args.generation.max_new_tokens",
        "16",
        "--data.init_args.dataset_name",
        "null",
        "--data.init_args.dataset_config",
        "null",
        "--data.init_args.data_files",
        json.dumps(files),
        *extra,
    ]


def check_rows(calls: list[dict], answers: dict[str, str]) -> None:
    """Every scored prompt is the question through the chat template with the instruction, and the
    reward got that question's own answer."""
    assert calls
    for call in calls:
        for prompt, answer in zip(call["prompts"], call["answers"], strict=True):
            assert prompt.startswith(f"<|im_start|>system\n{BOXED_INSTRUCTION}<|im_end|>\n<|im_start|>user\n")
            assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
            question = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            assert answers[question] == answer


def metrics(cli) -> list[dict[str, str]]:
    return list(csv.DictReader((Path(cli.trainer.logger.log_dir) / "metrics.csv").open()))


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_the_gsm8k_recipe_runs_offline(name, tiny_qwen, gsm8k, tmp_path, capsys):
    """The recipe's three commands in one folder (docs/gsm8k.md): ``validate`` (the model before
    training), ``fit`` (two iterations, validating after the second instead of every 25), then
    ``validate --ckpt_path`` on the checkpoint it wrote, which answers as the trained model did."""
    files, answers = gsm8k
    config = CONFIGS[name]
    shipped = yaml.safe_load(config.read_text())
    assert shipped["model"]["init_args"]["policy"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert shipped["data"]["init_args"]["dataset_name"] == "openai/gsm8k"
    assert shipped["trainer"]["precision"] == "bf16-mixed"
    batch = {"ppo": "8", "grpo": "2"}[name]
    small = ["--trainer.limit_val_batches", "1", "--data.init_args.batch_size", batch]
    args = offline_args(config, tiny_qwen, files, tmp_path, *small)

    RecordingMathReward.calls.clear()
    cli = main(["validate", *args])
    (before,) = RecordingMathReward.calls
    check_rows([before], answers)
    assert float(cli.trainer.callback_metrics["eval/accuracy"]) == pytest.approx(
        sum(before["scores"]) / int(batch)
    )

    RecordingMathReward.calls.clear()
    run = [
        "--trainer.max_epochs",
        "1",
        "--trainer.limit_train_batches",
        "2",
        "--trainer.val_check_interval",
        "2",
    ]
    cli = main(["fit", *args, *run])
    ppo = cli.model.ppo
    critic = {"ppo": ("gae", True), "grpo": ("grpo", False)}[name]
    assert (ppo.advantage_estimator, cli.model.roles.has_critic) == critic
    # verl's rates and clips: actor lr 1e-6, critic lr 1e-5 in a group of its own, each clipped to 1.0
    groups = {"ppo": [1e-6, 1e-5], "grpo": [1e-6]}[name]
    assert [g["lr"] for g in cli.model.optimizers().optimizer.param_groups] == groups
    assert ppo.clip_limits == {"ppo": (1.0, 1.0), "grpo": (1.0,)}[name]
    assert cli.trainer.global_step == 2 * ppo.ppo_epochs * ppo.num_minibatches
    check_rows(RecordingMathReward.calls, answers)
    rollouts, validation = RecordingMathReward.calls[:2], RecordingMathReward.calls[2:]
    assert [len(c["prompts"]) for c in rollouts] == [int(batch) * ppo.num_generations] * 2
    (trained,) = validation  # greedy: one reply per question
    assert trained["prompts"] == before["prompts"]
    rows = metrics(cli)
    logged = [float(r["eval/accuracy"]) for r in rows if r.get("eval/accuracy")]
    assert logged == [pytest.approx(sum(trained["scores"]) / int(batch))]
    assert [r for r in rows if r.get("reward/accuracy")]  # the training batches' accuracy
    norms = {"ppo": ["policy/grad_norm", "val/grad_norm"], "grpo": ["train/grad_norm"]}[name]
    logged_norms = [[float(r[key]) for key in norms] for r in rows if r.get(norms[0])]
    assert len(logged_norms) == 2 and all(norm > 0 for row in logged_norms for norm in row)

    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    RecordingMathReward.calls.clear()
    capsys.readouterr()
    cli = main(["validate", *args, "--ckpt_path", str(checkpoint)])
    (after,) = RecordingMathReward.calls
    assert after["completions"] == trained["completions"]  # the checkpoint's weights answer
    accuracy = float(cli.trainer.callback_metrics["eval/accuracy"])
    assert accuracy == pytest.approx(sum(after["scores"]) / int(batch))
    assert "eval/accuracy" in capsys.readouterr().out  # the table validate prints
    main(["export", str(checkpoint), "--out", str(tmp_path / "exported")])
    assert (tmp_path / "exported" / "config.json").is_file()


def test_accuracy_counts_right_answers_of_greedy_replies(tiny_qwen, gsm8k, tmp_path):
    """eval/accuracy is the share of right final answers: the test split's answers are rewritten to
    what the model's greedy replies say for some questions (and to a number no reply holds for the
    rest), so the same greedy replies score exactly that share."""
    files, _ = gsm8k
    config = CONFIGS["ppo"]
    check = [
        "--trainer.limit_val_batches",
        "1",
        "--data.init_args.batch_size",
        "8",
        "--data.init_args.shuffle",
        "false",
    ]
    RecordingMathReward.calls.clear()
    main(["validate", *offline_args(config, tiny_qwen, files, tmp_path / "first", *check)])
    (first,) = RecordingMathReward.calls
    test = pd.read_parquet(files["test"])
    by_question = dict(zip(test["question"], range(len(test)), strict=True))
    numbers = {}  # each reply's final answer as the reward reads it, where it has one
    for prompt, completion in zip(first["prompts"], first["completions"], strict=True):
        question = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        if final_answer(completion) is not None:
            numbers[by_question[question]] = final_answer(completion)
    rewritten = test.copy()
    right = sorted(numbers)[: len(first["prompts"]) // 2]
    for index in range(len(rewritten)):
        truth = numbers[index] if index in right else "999999999"
        rewritten.loc[index, "answer"] = f"Worked out above.\n#### {truth}"
    path = tmp_path / "main" / "test-00000-of-00001.parquet"
    path.parent.mkdir()
    rewritten.to_parquet(path)
    RecordingMathReward.calls.clear()
    cli = main(
        [
            "validate",
            *offline_args(config, tiny_qwen, {**files, "test": str(path)}, tmp_path / "second", *check),
        ]
    )
    assert 1 <= len(right) < 8
    assert float(cli.trainer.callback_metrics["eval/accuracy"]) == pytest.approx(len(right) / 8)
    (second,) = RecordingMathReward.calls
    assert second["completions"] == first["completions"]  # greedy: the same replies


def test_the_hub_dataset_without_a_network_is_one_line(tiny_qwen, tmp_path, monkeypatch, capsys):
    """As shipped (``openai/gsm8k`` from the hub) on a machine that cannot reach it: one line."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    args = offline_args(CONFIGS["ppo"], tiny_qwen, {}, tmp_path)
    at = args.index("--data.init_args.dataset_name")
    del args[at : at + 6]  # keep the config's dataset_name, dataset_config, and no data_files
    message = cli_usage_error(capsys, ["fit", *args])
    assert "openai/gsm8k" in message
