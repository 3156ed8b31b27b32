r"""lightning_ppo.tasks.math_answer: the math answer-correctness reward on hand-checked cases, called
as TRL calls a reward and through a module's ``reward_fn`` by class path and by import path."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from lightning_ppo.module import PPOLightningModule
from lightning_ppo.rewards import RewardCall, ScoreInputs
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.warn import LightningPPOWarning
from lightning_ppo.tasks.math_answer import MathAnswerReward, gsm8k_answer, math_answer_reward
from lightning_ppo.tasks.math_checkers import Checkers, checkers

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


# MATH-style answers and the fallback's rules (issue 49, items 11-15; docs/gsm8k.md, "How an answer
# is read"): each row scored otherwise before.
MATH_STYLE = [
    # 11: a comma groups thousands only inside a number; elsewhere it separates a pair or a list
    ("(1, 2)", r"\boxed{2}", False),
    ("(1, 2)", r"\boxed{(1, 2)}", True),
    ("2, -3", r"\boxed{-1}", False),
    ("2, -3", r"\boxed{-3, 2}", True),
    ("#### 1,234", r"\boxed{1234}", True),
    ("1{,}234", r"\boxed{1,234}", True),
    # 12: a ground truth is read as LaTeX, the whole of it
    (r"2\sqrt{3}", r"\boxed{2}", False),
    (r"2\sqrt{3}", r"\boxed{2\sqrt{3}}", True),
    (r"3\pi", r"\boxed{3}", False),
    (r"3\pi", r"\boxed{3\pi}", True),
    (r"5\sqrt{2}", r"\boxed{5}", False),
    (r"5\sqrt{2}", r"\boxed{5\sqrt{2}}", True),
    (r"5\sqrt{2}", r"\boxed{\sqrt{50}}", True),
    (r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{\sqrt{3}}{2}}", True),
    (r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{1}{2}}", False),
    ("x^2+1", r"\boxed{1 + x^2}", True),
    ("x^2+1", r"\boxed{x^2}", False),
    (r"\text{(C)}", r"\boxed{\text{(C)}}", True),
    (r"\text{(C)}", r"\boxed{\text{(D)}}", False),
    # 13: the last box is the answer, not the set of all boxes
    ("72", r"May: \boxed{24}. Total: \boxed{72}", True),
    ("24", r"May: \boxed{24}. Total: \boxed{72}", False),
    # 14: every side of an equation in the box must be the answer (or a name: x = 72)
    ("72", r"\boxed{73 = 72}", False),
    ("72", r"\boxed{72 \approx 73}", False),
    ("72", r"\boxed{48 + 24 = 72}", True),
    ("72", r"\boxed{x = 72}", True),
    ("y = 2x + 1", r"\boxed{y = 1 + 2x}", True),
    # 15: the fallback, decided (docs/gsm8k.md)
    ("72", "<answer>72</answer>", True),  # an answer tag is read as a box is
    ("72", "<answer>So 72 clips.</answer> 73", True),
    ("72", "(72)", True),  # a number after any non-word character
    ("72", "Total:72", True),
    ("-5", "\u22125", True),  # Unicode's minus sign is a minus
    ("72", r"\boxed{72.}", True),  # a sentence's full stop inside the box is not part of the answer
    ("72", r"\boxed{72} \boxed{}", True),  # an empty box is no answer
    ("1000", "1e3", True),  # scientific notation
    ("5100", "He has 5 100-dollar bills.", False),  # a space never groups digits: 5, then 100
    ("100", "He has 5 100-dollar bills.", True),  # ... and the last number is the answer
    ("18", "The answer is 18 (3 x 6).", True),  # after "the answer is", the first number
]


@pytest.mark.parametrize(("truth", "completion", "right"), CASES + MATH_STYLE)
def test_hand_checked_cases(truth, completion, right):
    assert math_answer_reward(["q"], [completion], answer=[truth]) == [float(right)]


def test_gsm8k_answer_is_the_last_line_after_the_hashes():
    assert gsm8k_answer(GSM8K_ANSWER) == "72"
    assert gsm8k_answer("#### 1,234") == "1,234"  # its number reads 1234 (commas in groups of three)
    assert gsm8k_answer(" 0.5 ") == "0.5"
    assert gsm8k_answer("(1, 2)") == "(1, 2)"


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
    assert scores == [1.0, 0.0] and extra == {"correct": [1.0, 0.0]}
    assert metric == {"accuracy": 0.5, "timed_out": 0.0}


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


def test_off_the_main_thread_the_reward_still_answers_and_is_bounded():
    """math-verify's timeouts need SIGALRM, which only a main thread may set: a reward run on another
    thread (an async pipeline, a reward server) still answers, and a slow answer is still cut (its
    worker's main thread has the alarm), where math-verify alone would compute on for minutes."""
    from concurrent.futures import ThreadPoolExecutor

    reward = MathAnswerReward(answer_timeout=0.5)
    completions = [r"\boxed{1/2}", "3", r"\boxed{(10^{100})!}"]
    with ThreadPoolExecutor(1) as pool, pytest.warns(LightningPPOWarning):
        scores = pool.submit(reward, ["q"] * 3, completions, answer=["0.5", "4", "72"]).result()
    assert scores == [1.0, 0.0, 0.0]


SLOW = (r"\boxed{9^{9^{9^{9}}}}", r"\boxed{(10^{100})!}")  # sympy cannot compare either to 72 in seconds


def test_an_answer_too_slow_to_check_scores_zero_and_is_counted():
    """Each answer within answer_timeout (in a worker process): a slow one scores 0.0, is counted in
    reward/timed_out and warned about once; the others in its batch are checked as usual."""
    reward = MathAnswerReward(answer_timeout=0.5)
    metric: dict = {}
    completions = [SLOW[0], r"\boxed{72}", SLOW[1], "71"]
    with pytest.warns(LightningPPOWarning):
        scores = reward(["q"] * 4, completions, answer=["72"] * 4, log_metric=metric.__setitem__)
    assert scores == [0.0, 1.0, 0.0, 0.0] and metric == {"accuracy": 0.25, "timed_out": 0.5}


def test_a_batch_is_cut_at_batch_timeout_and_the_workers_start_again():
    """Past batch_timeout the workers are killed (a computation in C ignores their alarms), what was
    not checked scores 0.0, and the next batch starts new workers. Answers take milliseconds each,
    first: a slow answer later in the batch never holds them back."""
    reward = MathAnswerReward(workers=2, answer_timeout=2.0, batch_timeout=2.0)
    pool = checkers(2)
    reward(["q"], ["1"], answer=["1"])
    first = [worker.process.pid for worker in pool._workers]
    metric: dict = {}
    completions = [r"\boxed{72}", "72", *SLOW * 3]
    with pytest.warns(LightningPPOWarning):
        scores = reward(["q"] * 8, completions, answer=["72"] * 8, log_metric=metric.__setitem__)
    assert scores == [1.0, 1.0] + [0.0] * 6 and metric["timed_out"] == 0.75
    assert pool._workers == []  # killed at the deadline, not left computing
    assert reward(["q"] * 2, ["7", r"\boxed{8}"], answer=["7", "9"]) == [1.0, 0.0]
    assert not set(first) & {worker.process.pid for worker in pool._workers}


def test_a_worker_that_died_is_replaced():
    pool = checkers(1)
    assert pool.check([("1", "1")], 5.0, 10.0) == [True]
    (worker,) = pool._workers
    worker.process.kill()
    worker.process.wait()
    assert pool.check([("2", "2"), ("2", "3")], 5.0, 10.0) == [True, False]


def test_a_worker_killed_mid_batch_costs_no_other_answer():
    """A worker killed in the first round (the OOM killer, a crash) loses the answer it held then; the
    second round checks that one and the rest on the live workers (a dead one's turn took an answer
    and dropped it, scored 0.0 though right)."""
    pool = Checkers(2)
    try:
        pool.check([("1", "1")], 5.0, 10.0)
        right = r"\boxed{((((" + "+".join(["1"] * 72) + "))))}"  # about 1 s to check: a second round
        threading.Timer(0.1, pool._workers[0].process.kill).start()
        assert pool.check([("72", right)] * 3, 10.0, 120.0) == [True] * 3
    finally:
        pool.close()


def test_a_ctrl_c_during_a_batch_leaves_the_next_batch_its_own_answers():
    """A Ctrl-C stops a batch (in a notebook the process goes on to fit again): its workers are stopped,
    so no reply of the interrupted batch is read as the next batch's (18 of 20 wrong answers scored
    right before)."""
    pool = Checkers(1)
    try:
        right = r"\boxed{" + "+".join(["1"] * 35) + "+37}"
        ctrl_c = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            pool.check([("72", right)] * 20000, 5.0, 600.0)
        assert pool.check([("1", r"\boxed{2}")] * 20, 5.0, 60.0) == [False] * 20
    finally:
        pool.close()


def _checker_processes() -> list[int]:
    """The live (not zombie) math-checker processes this process started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == os.getpid() and b"math_reading.py" in command:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_ctrl_c_while_the_workers_start_leaves_none_running():
    """A Ctrl-C while the workers start (a second or two: sympy's import) stops those started."""
    pool, others = Checkers(2), set(_checker_processes())  # other tests' pools live on
    ctrl_c = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    ctrl_c.start()
    with pytest.raises(KeyboardInterrupt):
        pool.check([("1", "1")], 5.0, 10.0)
    assert set(_checker_processes()) - others == set()  # two before


def test_in_this_process_with_no_workers():
    """workers=0: checked here, one after another (no bound on the batch), with the same rules."""
    reward = MathAnswerReward(workers=0)
    completions = [r"\boxed{2\sqrt{3}}", r"\boxed{2}", r"May: \boxed{24}. Total: \boxed{72}"]
    assert reward(["q"] * 3, completions, answer=[r"2\sqrt{3}", r"2\sqrt{3}", "72"]) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"workers": -1}, "workers must be 0 or more, got -1"),
        ({"answer_timeout": 0}, "answer_timeout must be more than 0 seconds, got 0.0"),
        ({"answer_timeout": float("nan")}, "answer_timeout must be more than 0 seconds, got nan"),
        ({"answer_timeout": 20}, "batch_timeout must be at least answer_timeout (20 s), got 10.0"),
    ],
)
def test_settings_that_cannot_work_are_one_line(settings, named):
    with pytest.raises(UsageError) as err:
        MathAnswerReward(**settings)
    assert str(err.value) == f"MathAnswerReward {named}"


def test_a_module_in_the_working_folder_does_not_shadow_the_checkers_libraries(tmp_path, monkeypatch):
    """The workers start with `python -c`, whose import path began with the working folder: a
    user's json.py there was imported in place of the library's (the workers failed to start)."""
    (tmp_path / "json.py").write_text("raise ImportError('the json.py of the working folder')\n")
    monkeypatch.chdir(tmp_path)
    pool = Checkers(1)
    try:
        assert pool.check([("72", "72"), ("72", "73")], 5.0, 10.0) == [True, False]
    finally:
        pool.close()
