"""Diversity metrics against hand-counted batches, and the two guardrails they and the KL feed:
answers converging on one phrase while the score rises, and steps too small to matter."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings
from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch

from benchmarks.diversity import batches as benchmark_batches
from benchmarks.diversity import before
from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward, digits_score
from lightning_ppo.watch.diversity import Diversity, _shared_part, normalise
from lightning_ppo.watch.guardrails import Guardrails, IterationView
from tests.helpers import fit_warnings, quiet_trainer

CALM = {"approx_kl": 0.02, "clipfrac": 0.1, "kl": 3.0, "kl_coef": 0.05, "kl_coef_pinned": False}


def test_the_metrics_of_a_hand_counted_batch():
    d = Diversity.of(["a", "a", "b", "c"], ["Yes!", "yes", "no  way", "Yes."])
    # answers as compared: yes, yes, "no way", yes; "yes" went to prompts a and c of 3
    assert d.top_share == pytest.approx(2 / 3) and d.top_answer == "Yes!" and d.prompts == 3
    assert d.distinct_1 == pytest.approx(3 / 5)  # yes yes no way yes
    assert d.distinct_2 == 1.0  # one pair of words in all: (no, way)
    # pairs across prompts: a-b 0, a-c 1, a-b 0, a-c 1, b-c 0
    assert d.overlap == pytest.approx(2 / 5)
    assert set(d.metrics()) == {
        "diversity/top_share",
        "diversity/distinct_1",
        "diversity/distinct_2",
        "diversity/overlap",
    }


def test_a_varied_batch_and_an_empty_one():
    varied = Diversity.of(["1=", "2=", "3=", "4="], ["11", "22", "33 44", "55"])
    assert varied.top_share == 0.25 and varied.distinct_1 == 1.0 and varied.overlap == 0.0
    empty = Diversity.of(["1=", "2="], ["", ""])
    assert empty.top_share == 1.0 and empty.distinct_1 == 1.0 and empty.overlap == 1.0
    assert normalise("  The AND, has paper!") == "the and has paper"


def test_every_answer_the_same_overlaps_fully_whatever_the_group_size():
    """num_generations 64: the first 64 rows are one prompt's group, with no pair across prompts
    (read 0.0 before); the overlap now compares every prompt's first responses."""
    prompts = [p for p in ("1=", "2=", "3=") for _ in range(64)]
    same = Diversity.of(prompts, ["12345"] * len(prompts))
    assert same.overlap == 1.0 and same.top_share == 1.0
    varied = Diversity.of(prompts, [f"{p}{i}" for p in "abc" for i in range(64)])
    assert varied.overlap == 0.0


@pytest.mark.parametrize("a, b", [("-12", "12"), ("x+y", "x-y"), ("3.5", "3,5"), ("x + y", "x - y")])
def test_different_answers_stay_different(a, b):
    assert normalise(a) != normalise(b)
    assert Diversity.of(["1=", "2="], [a, b]).top_share == 0.5  # one prompt each: no common answer


def test_sentence_punctuation_quotes_and_case_do_not_make_an_answer_new():
    assert {normalise(x) for x in ["Yes", "yes.", '"Yes!"', "(yes)", " YES ?"]} == {"yes"}
    assert normalise("It is -12.") == "it is -12" and normalise("3.5!") == "3.5"


def _view(iteration, score, completions, prompts=None, kl=3.0, approx_kl=0.02, scores_std=0.3):
    prompts = prompts or [f"{i}=" for i in range(len(completions))]
    stats = {**CALM, "kl": kl, "approx_kl": approx_kl}
    return IterationView(
        iteration,
        list(completions),
        scores_std=scores_std,
        kl_coef_base=CALM["kl_coef"],
        score=score,
        entropy=1.0,
        diversity=Diversity.of(prompts, list(completions)),
        **stats,
    )


VARIED = ["11", "22", "33", "44", "55", "66", "77", "88"]
STOCK = ["the and has paper, then restart it."] * 5 + ["11", "22", "33"]


def test_converging_answers_warn_once_while_the_score_rises():
    rails = Guardrails(PPOConfig(), lr=1e-5)
    for i in range(1, 6):
        assert rails.observe(_view(i, 0.1, VARIED)) == []
    assert rails.observe(_view(6, 0.3, STOCK)) == [] and rails.observe(_view(7, 0.3, STOCK)) == []
    (message,) = rails.observe(_view(8, 0.35, STOCK))
    assert message.startswith(
        "answers are converging: 62% of the batch's 8 different prompts got the same answer "
        "('the and has paper, then restart it.') at iteration 8 while objective/scores rose from 0.1 to 0.35"
    )
    assert "lightning-ppo samples" in message and "ppo.kl_coef" in message and "entropy_coef" in message
    assert rails.observe(_view(9, 0.4, STOCK)) == []  # once


def test_converging_answers_stay_quiet_without_a_rising_score_or_with_one_prompt():
    flat = Guardrails(PPOConfig(), lr=1e-5)
    for i in range(1, 12):
        assert flat.observe(_view(i, 0.1, VARIED if i <= 5 else STOCK)) == []  # the score did not rise
    one_prompt = Guardrails(PPOConfig(), lr=1e-5)  # the reveal task: every prompt is "="
    for i in range(1, 12):
        assert one_prompt.observe(_view(i, 0.1 * i, STOCK, prompts=["="] * 8)) == []


def test_steps_too_small_warn_once_after_the_warm_up_naming_the_learning_rate():
    rails = Guardrails(PPOConfig(), lr=1e-7)
    assert rails.observe(_view(49, 0.1, VARIED, kl=0.01, approx_kl=1e-6)) == []  # still warming up
    (message,) = rails.observe(_view(50, 0.1, VARIED, kl=0.01, approx_kl=1e-6))
    assert message.startswith("objective/kl 0.01 and policy/approxkl_avg 1e-06 at iteration 50 while the")
    assert "learning rate 1e-07 is likely too small" in message and "1e-4 to 1e-3" in message
    assert rails.observe(_view(51, 0.1, VARIED, kl=0.01, approx_kl=1e-6)) == []
    moving = Guardrails(PPOConfig(), lr=1e-3)
    assert moving.observe(_view(60, 0.1, VARIED, kl=0.5, approx_kl=1e-6)) == []  # it has moved
    no_spread = Guardrails(PPOConfig(), lr=1e-7)
    assert no_spread.observe(_view(60, 0.1, VARIED, kl=0.01, approx_kl=1e-6, scores_std=0.0)) == []


def _slow(iteration=60, kl_coef=0.01, kl_coef_base=None, kl=0.01, approx_kl=1e-6):
    """A policy that has barely moved after the warm-up, the scores' std 0.3."""
    view = _view(iteration, 0.1, VARIED, kl=kl, approx_kl=approx_kl)
    return replace(view, kl_coef=kl_coef, kl_coef_base=kl_coef if kl_coef_base is None else kl_coef_base)


def test_steps_too_small_stay_quiet_while_the_kl_penalty_holds_the_policy():
    adaptive = PPOConfig(kl_target=6.0, kl_coef=0.05)
    assert Guardrails(adaptive, lr=1e-7).observe(_slow(kl_coef=0.5)) == []  # outweighs the spread 0.3
    raised = _slow(kl_coef=0.1, kl_coef_base=0.2)  # the controller raised it above its start 0.05
    assert Guardrails(adaptive, lr=1e-7).observe(raised) == []
    assert Guardrails(PPOConfig(kl_coef=1.0), lr=1e-7).observe(_slow(kl_coef=1.0)) == []  # fixed, as large
    at_target = Guardrails(PPOConfig(kl_target=0.02), lr=1e-7).observe(_slow(kl=0.015))
    assert at_target == []  # a KL this small is what the user asked for
    (message,) = Guardrails(adaptive, lr=1e-7).observe(_slow(kl_coef=0.01))  # too weak to hold it
    assert "the KL penalty (kl_coef 0.01) is too weak" in message


def test_steps_too_small_never_call_a_usual_rate_too_small():
    """The reported run: kl_target on a warm-started policy at the README's lr 1e-5, told at iteration
    61 that 1e-5 "is likely too small ... pretrained models 1e-6 to 1e-5"; its KL then rose to 8."""
    reported = _slow(61, kl_coef=0.018, kl_coef_base=0.05, kl=0.05, approx_kl=2e-4)
    assert Guardrails(PPOConfig(kl_target=6.0), lr=1e-5).observe(reported) == []
    for lr in (1e-6, 1e-5, 5e-5, 1e-4, 1e-3, 1e-2):  # inside a usual range, or above them all
        assert Guardrails(PPOConfig(), lr=lr).observe(_slow()) == [], lr
    (message,) = Guardrails(PPOConfig(), lr=2e-5).observe(_slow())  # above pretrained, below LoRA/tiny
    assert "learning rate 2e-05 is likely too small" in message and "1e-4 to 1e-3" in message
    assert "1e-6 to 1e-5" not in message  # no rate below the one in use is offered


# ----------------------------------------------------------------- end to end


def pays_one_phrase(prompts, completions, batch):
    """The quickstart's score against "12345" whatever the prompt: one phrase to exploit."""
    return [digits_score(c, "12345", in_order=True) for c in completions]


class StopOnceFired(pl.Callback):
    """Ends the fit at the iteration the guardrail ``name`` fired: the tests ask whether it fires
    within the iterations given, and what it says then; the iterations after it change neither."""

    def __init__(self, name: str) -> None:
        self.name = name

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if self.name in module.guardrails.fired:
            trainer.should_stop = True


def fit_until_fired(module: PPOLightningModule, data, iterations: int, name: str) -> list[str]:
    """:func:`tests.helpers.fit_warnings` ended once the guardrail ``name`` has fired."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer("unused", iterations, callbacks=[StopOnceFired(name)]).fit(module, datamodule=data)
    return [str(w.message) for w in caught]


def _quickstart(policy, reward, lr: float) -> PPOLightningModule:
    return PPOLightningModule(
        policy=str(policy),
        reward_fn=reward,
        ppo=PPOConfig(kl_coef=0.01),
        generation=GenerationConfig(max_new_tokens=8),
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
    )


def test_a_reward_that_pays_one_phrase_is_said_to_make_the_answers_converge(tiny_digits):
    torch.manual_seed(0)
    module = _quickstart(tiny_digits, pays_one_phrase, lr=1e-3)
    data = DigitsDataModule(num_prompts=4096, batch_size=32, max_prompt_length=8)
    caught = fit_until_fired(module, data, iterations=60, name="converging")
    assert "converging" in module.guardrails.fired, module.last_samples.completions
    message = next(m for m in caught if m.startswith("answers are converging: "))
    assert "got the same answer ('123" in message  # the phrase the reward pays, or its first digits


def test_a_learning_rate_far_too_small_is_said_after_the_warm_up(tiny_digits):
    torch.manual_seed(0)
    module = _quickstart(tiny_digits, DigitsReward(), lr=1e-7)
    data = DigitsDataModule(num_prompts=4096, batch_size=16, max_prompt_length=8)
    caught = fit_warnings(module, data, iterations=52)
    assert module.guardrails.fired == {"small_steps"}
    message = next(m for m in caught if m.startswith("objective/kl "))
    assert "at iteration 50 while the scores vary" in message and "learning rate 1e-07" in message


# ----------------------------------------------------------------- near-copies

# A sentence reward on a chat corpus, as a user tried it: different first words, 13 of 16 answers
# ending in the same words (the run of issue 42), against answers a healthy run gives.
OPENINGS = [
    "Well, I think",
    "Honestly,",
    "My friend said",
    "The weather was nice and",
    "We went home early,",
    "Sure thing,",
    "It was late, so",
    "Nobody knows why, but",
    "After dinner",
    "In the morning",
    "Yes, and",
    "The cat sat down and",
    "Oh no,",
    "Look at that:",
    "My brother laughed.",
    "Later that day",
]
ENDING = "and that is all there is to it."
COLLAPSED = [f"{o} {ENDING}" for o in OPENINGS[:13]] + [
    "I would rather not say.",
    "Try the blue one first.",
    "It rained all week in the hills.",
]
HEALTHY = [
    "Paris is the capital of France.",
    "Boil the pasta for about ten minutes, then drain it.",
    "I'd start with a short walk every morning.",
    "The train leaves at half past six.",
    "Water boils at a lower temperature up in the mountains.",
    "You can return it within thirty days with the receipt.",
    "Seven times eight is fifty-six.",
    "Try restarting the router before calling support.",
    "The meeting moved to Thursday afternoon.",
    "Cats sleep for most of the day.",
    "A haiku has three lines of five, seven and five syllables.",
    "Add a pinch of salt to bring out the sweetness.",
    "The library closes at eight on weekdays.",
    "Photosynthesis turns light into chemical energy.",
    "Her flight was delayed by two hours.",
    "Use a comma before the conjunction in a compound sentence.",
]
# Answers that follow the format a task asks for: a shared closing line, but a small part of each.
FORMATTED = [f"{h} So the final answer is {n}." for n, h in enumerate(HEALTHY)]
CHAT_PROMPTS = [f"question {i}" for i in range(16)]


def test_near_copies_are_read_as_one_shared_part_and_varied_answers_as_none():
    collapsed = Diversity.of(CHAT_PROMPTS, COLLAPSED)
    assert collapsed.top_share == 1 / 16  # no two answers the same: the old reading saw nothing
    assert collapsed.shared == " " + ENDING and collapsed.shared_share == 13 / 16
    each = [(len(ENDING) + 1) / len(c) for c in COLLAPSED[:13]]
    assert collapsed.shared_cover == pytest.approx(sum(each) / 13)
    assert 0.5 < collapsed.shared_cover < 0.8  # measured 0.66: most of each answer
    healthy = Diversity.of(CHAT_PROMPTS, HEALTHY)
    assert healthy.shared == " the " and healthy.shared_cover < 0.2  # a common word: a sliver of each
    formatted = Diversity.of(CHAT_PROMPTS, FORMATTED)
    assert formatted.shared == ". So the final answer is " and formatted.shared_cover < 0.5
    # responses to one prompt (a GRPO group) share nothing across prompts
    assert Diversity.of(["p"] * 4 + ["q"], [ENDING] * 4 + ["no"]).shared == ""
    # text without spaces has near-copies too
    digits = Diversity.of([f"{i}=" for i in range(8)], [f"{i}{i + 1}77777" for i in range(6)] + ["12", "345"])
    assert digits.shared == "77777" and digits.shared_share == 6 / 8


def test_near_copies_warn_once_while_the_score_rises_quoting_the_shared_part():
    rails = Guardrails(PPOConfig(), lr=1e-3)
    for i in range(1, 6):
        assert rails.observe(_view(i, 0.1, HEALTHY, prompts=CHAT_PROMPTS)) == []
    assert rails.observe(_view(6, 0.3, COLLAPSED, prompts=CHAT_PROMPTS)) == []
    assert rails.observe(_view(7, 0.3, COLLAPSED, prompts=CHAT_PROMPTS)) == []
    (message,) = rails.observe(_view(8, 0.4, COLLAPSED, prompts=CHAT_PROMPTS))
    assert message.startswith(
        "answers are converging: the answers to 81% of the batch's 16 different prompts are near-copies "
        f"sharing {ENDING!r} ("
    )
    assert "at iteration 8 while objective/scores rose from 0.1 to 0.4" in message
    assert "check whether the reward pays for that text" in message
    assert "raise ppo.kl_coef (now 0.05) or set a ppo.kl_target" in message
    assert "set ppo.entropy_coef" in message and "lower the learning rate (now 0.001" in message
    assert rails.observe(_view(9, 0.5, COLLAPSED, prompts=CHAT_PROMPTS)) == []  # once
    set_already = Guardrails(PPOConfig(kl_target=4.0, entropy_coef=0.01), lr=1e-3)
    views = [_view(i, 0.1, HEALTHY, prompts=CHAT_PROMPTS) for i in range(1, 6)]
    views += [_view(i, 0.4, COLLAPSED, prompts=CHAT_PROMPTS) for i in range(6, 9)]
    (advice,) = [m for view in views for m in set_already.observe(view)]
    assert "lower ppo.kl_target (now 4)" in advice and "raise ppo.entropy_coef (now 0.01)" in advice


def test_varied_and_formatted_answers_stay_quiet_while_the_score_rises():
    for answers in (HEALTHY, FORMATTED):
        rails = Guardrails(PPOConfig(), lr=1e-3)
        views = [_view(i, 0.1 * i, answers, prompts=CHAT_PROMPTS) for i in range(1, 20)]
        assert [m for view in views for m in rails.observe(view)] == []


def test_the_same_words_in_another_order_are_converging_answers_too():
    words = "cheap fast reliable friendly local service".split()
    shuffled = [" ".join(words[i:] + words[:i]) + f" {i}" for i in range(6)] * 2
    d = Diversity.of(CHAT_PROMPTS[:12], shuffled)
    assert d.overlap > 0.5 and d.top_share == 2 / 12
    rails = Guardrails(PPOConfig(), lr=1e-3)
    views = [_view(i, 0.1, HEALTHY[:12], prompts=CHAT_PROMPTS[:12]) for i in range(1, 6)]
    views += [_view(i, 0.4, shuffled, prompts=CHAT_PROMPTS[:12]) for i in range(6, 9)]
    (message,) = [m for view in views for m in rails.observe(view)]
    assert message.startswith("answers are converging: ") and "diversity/overlap 0.7" in message


def pays_a_phrase_after_the_prompts_digits(prompts, completions, batch):
    """Half for the prompt's digits in the first three characters (different for each prompt), half
    for "77777" after them (partial credit for its start): a phrase inside otherwise varied answers."""
    scores = []
    for prompt, completion in zip(prompts, completions, strict=True):
        digits = sum(ch in prompt.rstrip("=") for ch in completion[:3]) / 3
        phrase = max(k for k in range(6) if "77777"[:k] in completion[3:])
        scores.append(0.5 * digits + 0.5 * phrase / 5)
    return scores


def test_a_reward_that_pays_a_phrase_inside_varied_answers_is_said_to_make_them_converge(tiny_digits):
    """Measured (one thread): answers like '5317777775', '281777770', no two alike in most batches
    (diversity/top_share <= 0.16 through 60 iterations, so the identical-answers reading never spoke);
    the shared '77777' in 53-72 % of the prompts' answers, 51-62 % of each, from iteration 20."""
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(tiny_digits),
        reward_fn=pays_a_phrase_after_the_prompts_digits,
        ppo=PPOConfig(kl_coef=0.01),
        generation=GenerationConfig(max_new_tokens=10),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    data = DigitsDataModule(num_prompts=4096, batch_size=32, max_prompt_length=8)
    caught = fit_until_fired(module, data, iterations=60, name="converging")
    assert "converging" in module.guardrails.fired, module.last_samples.completions
    message = next(m for m in caught if m.startswith("answers are converging: "))
    assert "77777" in message  # the phrase the reward pays, quoted


def _batch_of_near_copies(rng: random.Random) -> list[tuple[str, str]]:
    """A few prompts' answers of random words, most holding one phrase (once or repeated), some after
    a run of one character: ties, repeats and overlaps the search must take as it did."""
    words = "the cat sat on a mat and that is all there is to it so final answer 12 7 x".split()
    phrase = " ".join(rng.choice(words) for _ in range(rng.randrange(2, 8)))
    rows = []
    for i in range(rng.randrange(2, 12)):
        for _ in range(rng.randrange(1, 3)):
            text = " ".join(rng.choice(words) for _ in range(rng.randrange(0, 12)))
            if rng.random() < 0.6:
                cut = rng.randrange(len(text) + 1)
                text = text[:cut] + phrase * rng.randrange(1, 4) + text[cut:]
            if rng.random() < 0.2:
                text = rng.choice("ab7 ") * rng.randrange(0, 60) + text
            rows.append((f"p{i}", text))
    return rows


def test_the_shared_part_is_the_one_the_search_before_found():
    """The search before (re-finding every occurrence at each character: over 30 s on a collapsed
    batch, benchmarks/diversity.py) and today's find the same part, share and cover."""
    fixed = [
        COLLAPSED,
        HEALTHY,
        FORMATTED,
        ["a" * 300] * 16,
        [("So it is 4. " * 40)[:n] for n in range(300, 316)],
    ]
    batches = [list(zip(CHAT_PROMPTS, answers, strict=True)) for answers in fixed]
    batches += [_batch_of_near_copies(random.Random(seed)) for seed in range(400)]
    batches += [rows for _, rows in benchmark_batches(16, 300) + benchmark_batches(16, 1000)[1:]]
    for rows in batches:
        assert _shared_part(rows) == before(rows), rows


def test_a_collapsed_batch_of_long_answers_shares_its_repeated_text():
    """64 answers of 4,000 repeated characters: the longest part read (400 characters), in all."""
    prompts = [f"question {i}" for i in range(64)]
    d = Diversity.of(prompts, ["a" * 4000] * 64)
    assert (d.shared, d.shared_share, d.shared_cover) == ("a" * 400, 1.0, pytest.approx(0.1))
    sentence = Diversity.of(prompts, [(f"Answer {i}. " + "So it is 4. " * 400)[:4000] for i in range(64)])
    assert len(sentence.shared) == 400 and sentence.shared_share == 1.0


def test_the_shared_part_does_not_depend_on_the_process():
    """A tie (X and Y each follow 'abcde' in two prompts' answers) goes to the first found, in every
    process: before, it went by the string hashes' order (PYTHONHASHSEED 0 'abcdeX', 2 'abcdeY')."""
    code = (
        "from lightning_ppo.watch.diversity import _shared_part;"
        "print(_shared_part([('a', 'abcdeX abcdeY'), ('b', 'abcdeX'), ('c', 'abcdeY')])[0])"
    )
    found = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("0", "2")
    }
    assert found == {"abcdeX"}
