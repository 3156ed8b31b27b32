r"""lightning_ppo.tasks.math_answer: the math answer-correctness reward on hand-checked cases, called
as TRL calls a reward and through a module's ``reward_fn`` by class path and by import path."""

from __future__ import annotations

import pytest
import torch

from lightning_ppo.module import PPOLightningModule
from lightning_ppo.rewards import RewardCall, ScoreInputs
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.tasks.math_answer import MathAnswerReward, gsm8k_answer, math_answer_reward

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)

# (ground truth as the column holds it, completion, right?): each checked by hand.
CASES = [
    ("0.5", r"Half of it: \boxed{1/2}", True),
    ("0.5", r"So the answer is $\boxed{\frac{1}{2}}$.", True),
    (r"\frac{1}{2}", "The answer is 0.5", True),
    ("1000", "In total they raised 1,000 dollars.", True),
    ("#### 1,000", "In total they raised 1000 dollars.", True),
    ("5", "It costs $5.00", True),
    ("$5.00", r"\boxed{5}", True),
    ("-3", "The temperature dropped to -3 degrees.", True),
    ("3", "The temperature dropped to -3 degrees.", False),
    ("#### -3", r"\boxed{-3}", True),
    ("72", "First I got 72, then I added 8 and got 80.", False),  # the last number is the answer
    ("72", "I thought 80, but it is 72", True),
    ("72", r"\boxed{72}, though 73 would also be close", True),  # a boxed answer wins over later numbers
    ("72", r"\boxed{73} and 72", False),
    ("72", "I do not know.", False),  # no answer at all
    ("72", "", False),
    (GSM8K_ANSWER, "She sold 24 in May, so 48 + 24 = 72 clips.\n#### 72", True),
    (GSM8K_ANSWER, "She sold 24 in May, so 48 + 24 = 72 clips.\n#### 96", False),
]


@pytest.mark.parametrize(("truth", "completion", "right"), CASES)
def test_hand_checked_cases(truth, completion, right):
    assert math_answer_reward(["q"], [completion], answer=[truth]) == [float(right)]


def test_gsm8k_answer_is_the_last_line_after_the_hashes():
    assert gsm8k_answer(GSM8K_ANSWER) == "72"
    assert gsm8k_answer("#### 1,234") == "1234"
    assert gsm8k_answer(" 0.5 ") == "0.5"


def test_the_format_term_pays_only_for_the_asked_for_format():
    reward = MathAnswerReward(format_weight=0.2)
    completions = [r"\boxed{72}", "72", r"\boxed{71}", "71", r"\boxed{ }"]
    assert reward(["q"] * 5, completions, answer=["72"] * 5) == pytest.approx([1.2, 1.0, 0.2, 0.0, 0.0])
    hashes = MathAnswerReward(format_weight=0.5, format_pattern=r"(?m)^#### -?\d")
    assert hashes(["q"] * 2, ["#### 72", "72"], answer=["72"] * 2) == [1.5, 1.0]


@pytest.mark.parametrize("truth", ["twelve", "", "#### ", "N/A"])
def test_a_ground_truth_that_does_not_parse_is_one_line_naming_the_row(truth):
    with pytest.raises(UsageError) as err:
        math_answer_reward(["q1", "How many\napples are left?"], ["1", "2"], answer=["1", truth])
    message = str(err.value)
    assert "\n" not in message and "row 1 of this batch" in message and repr(truth) in message
    assert "prompt 'How many apples are left?'" in message  # what finds the row in the dataset


def test_a_missing_answer_column_names_the_columns_there_are():
    with pytest.raises(UsageError, match=r"column 'solution'.*\['answer', 'question'\]"):
        MathAnswerReward(answer_column="solution")(["q"], ["1"], answer=["1"], question=["q"])


def test_conversational_completions_and_logging_hooks():
    """TRL hands conversational completions as message lists, and the logging hooks as keywords."""
    extra, metric = {}, {}
    scores = math_answer_reward(
        [[{"role": "user", "content": "q"}]] * 2,
        [[{"role": "assistant", "content": r"\boxed{4}"}], [{"role": "assistant", "content": "5"}]],
        answer=["4", "4"],
        log_extra=extra.__setitem__,
        log_metric=metric.__setitem__,
    )
    assert scores == [1.0, 0.0] and extra == {"correct": [1.0, 0.0]} and metric == {"accuracy": 0.5}


def test_both_forms_are_called_with_trls_keywords():
    assert RewardCall.of(math_answer_reward).trl and RewardCall.of(MathAnswerReward()).trl


def test_the_package_exports_both_forms_and_the_column_validation_reads():
    import lightning_ppo
    from lightning_ppo.scoring import ACCURACY_COLUMN

    assert lightning_ppo.MathAnswerReward is MathAnswerReward
    assert lightning_ppo.math_answer_reward is math_answer_reward
    extra: dict = {}
    MathAnswerReward()(["q"], ["7"], answer=["#### 7"], log_extra=extra.__setitem__)
    assert extra == {ACCURACY_COLUMN: [1.0]}


@pytest.mark.parametrize(
    "reward_fn",
    [
        {
            "class_path": "lightning_ppo.tasks.math_answer.MathAnswerReward",
            "init_args": {"format_weight": 0.1},
        },
        "lightning_ppo.tasks.math_answer.math_answer_reward",
    ],
)
def test_through_a_modules_reward_fn(reward_fn, tiny_gpt2):
    """By class path (as LightningCLI builds it) and by import path, the module scores with it."""
    if isinstance(reward_fn, dict):
        reward_fn = MathAnswerReward(**reward_fn["init_args"])
    module = PPOLightningModule(str(tiny_gpt2), reward_fn=reward_fn)
    batch = ScoreInputs(extras={"answer": ["#### 7", "#### 7", "0.5"], "question": ["a", "b", "c"]})
    scores = torch.as_tensor(module.score(["a", "b", "c"], [r"\boxed{7}", "8", "1/2"], batch))
    bonus = 0.1 if isinstance(reward_fn, MathAnswerReward) else 0.0
    assert scores.tolist() == pytest.approx([1.0 + bonus, 0.0, 1.0])
    assert module.scorer.columns == {"correct": [1.0, 0.0, 1.0]}


def test_off_the_main_thread_the_reward_still_answers():
    """math-verify's timeouts need SIGALRM, which only the main thread may set: a reward run on
    another thread (an async pipeline, a reward server) checks without them instead of failing."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        scores = pool.submit(
            math_answer_reward, ["q"] * 2, [r"\boxed{1/2}", "3"], answer=["0.5", "4"]
        ).result()
    assert scores == [1.0, 0.0]
