"""Environments and tools that take time: their calls run together, each within a time limit, and
what they answer is checked as a reward function's answer is (runs/bounded_calls, rollout/answers)."""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import math
import os
import random
import re
import signal
import sys
import threading
import time
from functools import partial

import pytest
import torch

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.config import EpisodeConfig
from lightning_ppo.rollout.answers import BadEnvironmentReward, EnvironmentFailure, EnvironmentTimeout
from lightning_ppo.rollout.episodes import Environment, StepResult, Turn
from lightning_ppo.runs.background_loop import LoopBlocked, background_loop
from lightning_ppo.runs.bounded_calls import CallExited, call_name, run_bounded
from lightning_ppo.runs.call_threads import LATE_CALLS
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.tasks.digits import DigitsDataModule, DigitsReward

# ----------------------------------------------------------------- run_bounded


def test_plain_calls_run_together_up_to_the_bound_and_answer_in_order():
    together = threading.Barrier(4, timeout=10)  # passes only when 4 calls run at once

    def call(i: int) -> int:
        together.wait()
        time.sleep(0.01 * (4 - i))  # the last call finishes first
        return i * i

    outcomes = run_bounded([partial(call, i) for i in range(4)], timeout=30, max_concurrency=4)
    assert [o.value for o in outcomes] == [0, 1, 4, 9]
    assert not any(o.timed_out or o.error for o in outcomes)


def test_one_at_a_time_keeps_the_calls_apart():
    running, most = [0], [0]
    lock = threading.Lock()

    def call() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    run_bounded([call] * 6, timeout=30, max_concurrency=1)
    assert most[0] == 1


def test_async_calls_are_awaited_together():
    started = []

    async def call(i: int) -> int:
        started.append(i)
        for _ in range(1000):  # every call waits until all have started: only together can they end
            if len(started) == 3:
                return i
            await asyncio.sleep(0.01)
        raise TimeoutError("the calls did not run together")

    outcomes = run_bounded([partial(call, i) for i in range(3)], timeout=30, max_concurrency=3)
    assert [o.value for o in outcomes] == [0, 1, 2]


def test_max_concurrency_bounds_async_calls_too():
    running, most = [0], [0]

    async def call() -> None:
        running[0] += 1  # all on the one loop thread: no lock needed
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.01)
        running[0] -= 1

    run_bounded([call] * 6, timeout=30, max_concurrency=2)
    assert most[0] == 2


def test_a_call_past_its_time_is_a_timeout_and_an_exception_an_error():
    def slow() -> str:
        time.sleep(3)
        return "late"

    async def slow_async() -> str:
        await asyncio.sleep(3)
        return "late"

    def broken() -> None:
        raise KeyError("gone")

    late, late_async, error, fine = run_bounded(
        [slow, slow_async, broken, lambda: "ok"], timeout=0.2, max_concurrency=4
    )
    assert late.timed_out and late_async.timed_out and late.value is None
    assert isinstance(error.error, KeyError) and not error.timed_out
    assert fine.value == "ok"


def _finishes_within(seconds: float, fn, *args):
    """``fn(*args)``'s result (or its exception, raised), asserting it came within ``seconds``: a call
    that would hang fails the test instead of hanging it."""
    done: dict = {}

    def target() -> None:
        try:
            done["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001
            done["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} did not return within {seconds} s"
    if "error" in done:
        raise done["error"]
    return done["value"]


def exits() -> None:
    sys.exit(3)


async def exits_async() -> None:
    await asyncio.sleep(0)
    sys.exit(3)


def interrupts() -> None:
    raise KeyboardInterrupt


async def interrupts_async() -> None:
    raise KeyboardInterrupt


async def answers() -> str:
    await asyncio.sleep(0.001)
    return "still here"


@pytest.mark.parametrize(
    ("call", "raised"),
    [
        (exits, "SystemExit(3)"),
        (exits_async, "SystemExit(3)"),
        (interrupts, "KeyboardInterrupt()"),
        (interrupts_async, "KeyboardInterrupt()"),
    ],
    ids=["exit", "async-exit", "interrupt", "async-interrupt"],
)
def test_an_exit_in_the_users_code_stops_the_run_in_one_line_and_the_loop_lives_on(call, raised):
    with pytest.raises(CallExited, match=rf"^{call.__name__} raised {re.escape(raised)}: code that training"):
        _finishes_within(20, run_bounded, [answers, call], 5, 4)
    outcomes = _finishes_within(20, run_bounded, [answers, answers], 5, 4)
    assert [o.value for o in outcomes] == ["still here"] * 2


def test_a_stopped_loop_is_replaced_rather_than_waited_on():
    loop = background_loop()
    loop.call_soon_threadsafe(loop.stop)
    for _ in range(400):  # bounded wait for its thread to leave run_forever
        if not loop.is_running():
            break
        time.sleep(0.05)
    outcomes = _finishes_within(20, run_bounded, [answers], 5, 4)
    assert outcomes[0].value == "still here" and background_loop() is not loop


async def cancels() -> None:
    raise asyncio.CancelledError("the user's own")


def test_a_cancelled_error_from_the_users_code_is_that_calls_error():
    cancelled, fine = _finishes_within(20, run_bounded, [cancels, answers], 5, 4)
    assert isinstance(cancelled.error, asyncio.CancelledError) and fine.value == "still here"


def first_match() -> str:
    return next(name for name in ("a", "b") if name == "c")  # no match: StopIteration


def ends_iteration() -> None:
    raise StopAsyncIteration


def exits_generator() -> None:
    raise GeneratorExit


def cancelled_by_hand() -> None:
    raise asyncio.CancelledError("the user's own")


@pytest.mark.parametrize(
    ("call", "raised"),
    [
        (first_match, StopIteration),
        (ends_iteration, StopAsyncIteration),
        (exits_generator, GeneratorExit),
        (cancelled_by_hand, asyncio.CancelledError),
    ],
    ids=["StopIteration", "StopAsyncIteration", "GeneratorExit", "CancelledError"],
)
def test_whatever_a_plain_call_raises_is_its_error_at_once_also_without_a_time_limit(call, raised):
    """asyncio's futures refuse StopIteration (``next()`` over no match, a common bug): the call must
    still settle as that error, not hang (no time limit) or pass for a timeout."""
    failed, fine = _finishes_within(20, run_bounded, [call, answers], None, 4)
    assert type(failed.error) is raised and not failed.timed_out and fine.value == "still here"
    assert LATE_CALLS.count(call_name(call)) == 0


def test_threads_of_timed_out_calls_are_bounded_and_a_stuck_function_stops_the_run():
    """Two calls hang past their limit (max_concurrency 2): the next call of the function starts no
    third thread, waits until they are stuck (four limits) and stops the run in one line (waiting
    out a limit for every later call would hide a stuck environment as timeouts); once the threads
    end, calls start again."""
    from lightning_ppo.runs.bounded_calls import CallsStuck

    release, started, lock = threading.Event(), [0], threading.Lock()

    def hangs() -> None:
        with lock:
            started[0] += 1
        release.wait(60)

    try:
        outcomes = run_bounded([hangs, hangs], timeout=0.1, max_concurrency=2)
        assert all(o.timed_out for o in outcomes)
        with pytest.raises(CallsStuck, match=r"^2 calls of .*hangs are still running after their time limit"):
            run_bounded([hangs], timeout=0.1, max_concurrency=2)
        assert started[0] == 2  # no third thread
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while LATE_CALLS.count(call_name(hangs)) and time.monotonic() < deadline:  # their threads end
        time.sleep(0.01)
    outcomes = run_bounded([hangs], timeout=10, max_concurrency=2)
    assert outcomes[0].value is None and not outcomes[0].timed_out and started[0] == 3


def test_a_late_call_is_not_a_stuck_one_and_one_at_a_time_stays_one_at_a_time():
    """``max_concurrency: 1`` and a call three times its limit: that call is a timeout, the next ones
    wait for its thread (never two at once) and then answer; the run does not stop."""
    running, most, lock = [0], [0], threading.Lock()

    def takes(seconds: float) -> float:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(seconds)
        with lock:
            running[0] -= 1
        return seconds

    calls = [partial(takes, 0.6), partial(takes, 0.01), partial(takes, 0.01)]
    late, *others = _finishes_within(20, run_bounded, calls, 0.2, 1)
    assert late.timed_out and [o.value for o in others] == [0.01, 0.01] and most[0] == 1


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_has_no_late_calls_of_its_parent():
    """The threads of a parent's late calls do not exist in a forked child (a ``ddp_fork`` rank): there
    no call waits for them, nor is its function taken for stuck."""
    release = threading.Event()

    def hangs_in_the_parent() -> str:
        release.wait(60)
        return "done"

    try:
        assert run_bounded([hangs_in_the_parent], timeout=0.1, max_concurrency=1)[0].timed_out
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # bounded: a child that waits forever dies of SIGALRM
            try:
                release.set()  # no thread of the parent's call here: it is this child's own call that answers
                outcome = run_bounded([hangs_in_the_parent], timeout=5, max_concurrency=1)[0]
                os._exit(
                    0
                    if outcome.value == "done" and LATE_CALLS.count(call_name(hangs_in_the_parent)) == 0
                    else 3
                )
            finally:
                os._exit(4)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        release.set()


def test_a_call_cut_off_by_a_ctrl_c_is_late_while_its_thread_runs():
    """A Ctrl-C (in a notebook, the run goes on in the same process) stops the wait, not the thread: it
    holds its place until it ends, as a timed-out call's does."""
    release = threading.Event()

    def hangs_until_released() -> None:
        release.wait(60)

    name = call_name(hangs_until_released)
    ctrl_c = threading.Timer(0.5, _thread.interrupt_main)
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_bounded([hangs_until_released], timeout=30, max_concurrency=1)
        deadline = time.monotonic() + 10
        while not LATE_CALLS.count(name) and time.monotonic() < deadline:  # the loop's thread counts it
            time.sleep(0.01)
        assert LATE_CALLS.count(name) == 1
    finally:
        ctrl_c.cancel()
        release.set()
    deadline = time.monotonic() + 10
    while LATE_CALLS.count(name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert LATE_CALLS.count(name) == 0


def test_an_async_call_that_ignores_its_cancellation_is_not_waited_for():
    """Past its limit the call is reported timed out at once, however long its cleanup takes."""

    async def stubborn() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(3)
            return "late"
        return "never"

    start = time.monotonic()
    outcomes = run_bounded([stubborn], timeout=0.2, max_concurrency=2)
    assert outcomes[0].timed_out and time.monotonic() - start < 2.5


def test_an_exit_in_a_call_nested_in_another_still_stops_the_run():
    """A tool that calls sys.exit inside an environment's step (a call in a call): the step's outcome
    is not an error that on_error: drop could drop, the run stops in one line."""

    def exits() -> None:
        sys.exit(3)

    def step() -> list:
        return run_bounded([exits], timeout=5, max_concurrency=2)

    with pytest.raises(CallExited, match=r"exits raised SystemExit\(3\)"):
        run_bounded([step], timeout=5, max_concurrency=2)


class BlocksTheLoop:
    def __init__(self, release: threading.Event) -> None:
        self.release = release

    async def step(self, turn: int) -> int:
        self.release.wait(60)  # a blocking call inside async def
        return turn


def test_an_async_call_that_blocks_the_loop_is_named_and_a_new_loop_serves_later_calls():
    release = threading.Event()
    try:
        with pytest.raises(
            LoopBlocked, match=r"^async def BlocksTheLoop.step blocked the event loop for over"
        ):
            _finishes_within(30, run_bounded, [partial(BlocksTheLoop(release).step, 1)], 0.2, 4)
    finally:
        release.set()
    assert [o.value for o in _finishes_within(20, run_bounded, [answers], 5, 4)] == ["still here"]


@pytest.mark.skipif(sys.platform != "linux", reason="counts the process's descriptors in /proc")
def test_a_given_up_loop_is_closed_once_what_blocked_it_returns():
    """Each given-up loop held an epoll object and a self-pipe (3 descriptors) until exit: the count
    grew by 3 per give-up. Once the blocking call returns, the old loop's thread closes it."""
    from lightning_ppo.runs import background_loop as module

    assert [o.value for o in _finishes_within(20, run_bounded, [answers], 5, 4)] == ["still here"]
    for thread in threading.enumerate():  # loops given up by earlier tests, closing meanwhile
        if thread.name == "lightning-ppo-async" and thread is not module._CURRENT.thread:
            thread.join(30)
    start = len(os.listdir("/proc/self/fd"))  # with one loop serving, as at the end of each round
    for _ in range(3):
        loop, thread = background_loop(), module._CURRENT.thread
        release = threading.Event()
        try:
            with pytest.raises(LoopBlocked):
                _finishes_within(30, run_bounded, [partial(BlocksTheLoop(release).step, 1)], 0.2, 4)
        finally:
            release.set()
        thread.join(30)  # bounded: the thread ends once the freed loop stops and is closed
        assert not thread.is_alive() and loop.is_closed()  # still open, and counted, before the fix
        assert [o.value for o in _finishes_within(20, run_bounded, [answers], 5, 4)] == ["still here"]
        assert len(os.listdir("/proc/self/fd")) == start
    assert [t.name for t in threading.enumerate()].count("lightning-ppo-async") == 1


class LandsLate(concurrent.futures.Future):
    """A call's answer that lands just after its waiter's poll timed out."""

    def result(self, timeout=None):
        if not self.done():
            self.set_result("answer")
            raise concurrent.futures.TimeoutError
        return super().result(timeout)


def test_an_answer_that_landed_before_its_loop_closed_is_returned():
    """A review: the waiter looked at the loop after its poll timed out, saw it closed and raised
    'stopped' though the answer had come in meanwhile."""
    from lightning_ppo.runs.background_loop import wait_on_loop

    loop = asyncio.new_event_loop()
    loop.close()
    assert wait_on_loop(LandsLate(), loop, None) == "answer"  # RuntimeError before


# ----------------------------------------------------------------- episodes


class Sleepy(Environment):
    """Answers after a random pause (so the calls finish out of order) with an observation and a
    reward drawn from the episode's rng: episodes that depend on which copy got which answer."""

    def __init__(self, most: float = 0.02) -> None:
        self.most = most

    def reset(self, prompt, row, rng: random.Random) -> None:
        self.rng = rng

    def step(self, turn: Turn) -> StepResult:
        time.sleep(random.random() * self.most)
        digit = self.rng.randrange(10)
        return StepResult(observation=f"={digit}=", reward=digit / 10)


class AsyncSleepy(Sleepy):
    async def reset(self, prompt, row, rng: random.Random) -> None:
        await asyncio.sleep(0.001)
        self.rng = rng

    async def step(self, turn: Turn) -> StepResult:
        await asyncio.sleep(random.random() * self.most)
        digit = self.rng.randrange(10)
        return StepResult(observation=f"={digit}=", reward=digit / 10)


def _module(path, environment, on_bad_reward: str = "error", **episode) -> PPOLightningModule:
    return PPOLightningModule(
        policy=str(path),
        reward_fn=DigitsReward(),
        environment=environment,
        episode=EpisodeConfig(**{"max_turns": 3, "max_tokens": 40, **episode}),
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1, on_bad_reward=on_bad_reward),
        generation=GenerationConfig(max_new_tokens=6),
    )


def _batch(module: PPOLightningModule):
    data = DigitsDataModule(num_prompts=64, batch_size=8, max_prompt_length=16)
    data.set_tokenizer(module.tokenizer)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _episodes(module: PPOLightningModule, seed: int = 0):
    torch.manual_seed(seed)
    return module.generate(_batch(module))


@pytest.mark.parametrize("environment", [Sleepy, AsyncSleepy], ids=["def", "async def"])
def test_concurrent_steps_give_the_episodes_serial_steps_give(environment, tiny_digits):
    serial = _episodes(_module(tiny_digits, environment(), max_concurrency=1))
    together = _episodes(_module(tiny_digits, environment(), max_concurrency=16))
    for name in ("response_ids", "response_mask", "context_mask", "turn_rewards"):
        torch.testing.assert_close(getattr(together, name), getattr(serial, name), rtol=0, atol=0)
    assert serial.context_mask.any() and serial.turn_rewards.any()  # observations and rewards came


class Stalls(Environment):
    def step(self, turn: Turn) -> StepResult:
        if turn.index == 1:
            time.sleep(5)
        return StepResult(observation="7=")


def test_a_step_past_the_timeout_is_named_or_its_episode_dropped_and_counted(tiny_digits):
    module = _module(tiny_digits, Stalls(), step_timeout=0.2)
    with pytest.raises(
        EnvironmentTimeout,
        match=r"^model.environment: Stalls.step did not answer within 0.2 s \(episode.step_timeout\) "
        r"\(turn 1, prompt '\d+='\)$",
    ):
        _episodes(module)
    dropping = _module(tiny_digits, Stalls(), step_timeout=0.2, on_error="drop")
    rollout = _episodes(dropping)
    stats = dropping.episode_runner.last_stats
    assert stats.timeouts.all() and stats.failed.all() and not rollout.response_mask.any()
    metrics = stats.metrics()
    assert metrics["episode/timeouts"].item() == metrics["episode/env_errors"].item() == 8


class FindsNothing(Environment):
    def step(self, turn: Turn) -> StepResult:
        return next(StepResult() for _ in () if turn.index)  # no match: StopIteration


def test_a_step_raising_stop_iteration_is_its_error_at_once_not_a_timeout(tiny_digits):
    module = _module(tiny_digits, FindsNothing(), step_timeout=None)
    with pytest.raises(
        EnvironmentFailure,
        match=r"^model.environment: FindsNothing.step raised StopIteration:  \(turn 0, prompt '\d+='\)$",
    ):
        _finishes_within(60, _episodes, module)
    dropping = _module(tiny_digits, FindsNothing(), step_timeout=None, on_error="drop")
    rollout = _finishes_within(60, _episodes, dropping)
    stats = dropping.episode_runner.last_stats
    assert stats.failed.all() and not stats.timeouts.any() and not rollout.response_mask.any()


class LateOnce(Environment):
    """One episode's second step takes three times ``episode.step_timeout``; every other step answers."""

    def __init__(self, late_prompt: str) -> None:
        self.late_prompt = late_prompt

    def reset(self, prompt, row, rng) -> None:
        self.prompt = prompt

    def step(self, turn: Turn) -> StepResult:
        if turn.index == 1 and self.prompt == self.late_prompt:
            time.sleep(0.6)
        return StepResult(observation="7=")


def test_one_late_step_one_at_a_time_drops_its_episode_and_the_run_goes_on(tiny_digits):
    probe = _module(tiny_digits, Sleepy())
    late = _batch(probe).prompts[3]
    module = _module(tiny_digits, LateOnce(late), step_timeout=0.2, on_error="drop", max_concurrency=1)
    _finishes_within(60, _episodes, module)
    stats = module.episode_runner.last_stats
    assert stats.timeouts.tolist() == [row == 3 for row in range(8)] and stats.failed.sum() == 1
    assert stats.turns.tolist() == [2 if row == 3 else 3 for row in range(8)]


class Rewards(Environment):
    """Rewards the first turn with ``value``, then ends the episode."""

    def __init__(self, value) -> None:
        self.value = value

    def step(self, turn: Turn) -> StepResult:
        return StepResult(reward=self.value, done=True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0.5", r"returned the reward '0.5' \(str\) \(turn 0, prompt '\d+='\): expected a number or None"),
        (torch.ones(2), r"returned the reward tensor\(\[1., 1.\]\) \(Tensor of shape \(2,\)\)"),
        ([1.0], r"returned the reward \[1.0\] \(list\)"),
    ],
    ids=["string", "tensor-shape", "list"],
)
def test_a_reward_that_is_not_a_number_is_one_line_naming_the_class_and_turn(value, expected, tiny_digits):
    with pytest.raises(UsageError, match=r"^model.environment: Rewards.step " + expected):
        _episodes(_module(tiny_digits, Rewards(value)))


def test_numbers_of_every_kind_are_rewards(tiny_digits):
    import numpy as np

    for value in (1, 0.25, np.float32(0.5), torch.tensor(0.75), torch.tensor([2.0])):
        rollout = _episodes(_module(tiny_digits, Rewards(value)))
        assert torch.allclose(rollout.turn_rewards.sum(1), torch.full((8,), float(value)))


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_nan_or_inf_reward_stops_in_one_line_or_drops_the_episode(value, tiny_digits):
    with pytest.raises(BadEnvironmentReward, match=rf"returned the reward {value} \(turn 0, prompt"):
        _episodes(_module(tiny_digits, Rewards(value)))
    dropping = _module(tiny_digits, Rewards(value), on_bad_reward="drop")
    rollout = _episodes(dropping)
    stats = dropping.episode_runner.last_stats
    assert stats.bad_rewards.all() and not rollout.response_mask.any()
    assert rollout.turn_rewards is None or torch.isfinite(rollout.turn_rewards).all()  # no NaN into the loss
    assert dropping.episode_runner.metrics()["episode/bad_rewards"].item() == 8


class Answers42(Environment):
    def step(self, turn: Turn) -> StepResult:
        return StepResult(observation=42)


def test_an_observation_of_the_wrong_type_names_the_class_turn_and_what_was_expected(tiny_digits):
    with pytest.raises(
        UsageError,
        match=r"^model.environment: Answers42.step returned the observation 42 \(int\) \(turn 0, prompt "
        r"'\d+='\): expected text, a chat message",
    ):
        _episodes(_module(tiny_digits, Answers42()))


def slow_lookup(key: str) -> str:
    time.sleep(5)
    return key


def test_a_tool_past_its_timeout_answers_the_policy_that_it_timed_out():
    from lightning_ppo.rollout.tools import ToolCall, ToolEnvironment

    tools = ToolEnvironment([slow_lookup], "text", timeout=0.2)
    assert tools.run(ToolCall("slow_lookup", "x")) == ("slow_lookup did not answer within 0.2 s", True)
    step = tools.step(Turn(0, "call slow_lookup: x;", [], True))
    assert step.observation == " error: slow_lookup did not answer within 0.2 s;" and tools.errors == 1


# ----------------------------------------------------------------- rewards that call out


async def slow_judge(prompts, completions, batch):
    await asyncio.sleep(5)
    return [1.0] * len(completions)


async def quick_judge(prompts, completions, batch):
    await asyncio.sleep(0.01)
    return [0.5] * len(completions)


def _scores(policy, on_bad_reward: str) -> torch.Tensor:
    from lightning_ppo.rewards import ScoreInputs

    module = PPOLightningModule(
        policy=str(policy),
        reward_fn=[slow_judge, quick_judge],
        ppo=PPOConfig(reward_timeout=0.2, on_bad_reward=on_bad_reward),
    )
    prompts, completions = ["1=", "2="], ["1", "2"]
    return module.score(prompts, completions, ScoreInputs({}, None, None))


def test_an_async_reward_past_its_timeout_is_one_line_or_its_completions_dropped(tiny_digits):
    with pytest.raises(
        UsageError, match=r"^reward 'slow_judge' did not answer within 0.2 s \(ppo.reward_timeout\)"
    ):
        _scores(tiny_digits, "error")
    scores = _scores(tiny_digits, "drop")
    assert torch.isnan(scores).all()  # NaN + 0.5: dropped by the module as any NaN score is


class Exits(Environment):
    def step(self, turn: Turn) -> StepResult:
        sys.exit(3)


class AsyncBlocks(Environment):
    release = threading.Event()

    async def step(self, turn: Turn) -> StepResult:
        AsyncBlocks.release.wait(60)  # time.sleep in async def: the loop can do nothing else
        return StepResult(done=True)


def test_an_environment_that_exits_stops_the_run_in_one_line_even_when_errors_drop(tiny_digits):
    module = _module(tiny_digits, Exits(), on_error="drop")
    with pytest.raises(CallExited, match=r"^Exits.step raised SystemExit\(3\): code that training calls"):
        _finishes_within(60, _episodes, module)


def test_an_async_environment_that_blocks_the_loop_is_named_in_one_line(tiny_digits):
    module = _module(tiny_digits, AsyncBlocks(), on_error="drop", step_timeout=0.2)
    try:
        with pytest.raises(LoopBlocked, match=r"^async def AsyncBlocks.step blocked the event loop"):
            _finishes_within(60, _episodes, module)
    finally:
        AsyncBlocks.release.set()


class _Index:
    """A tool's object that cannot be copied (it holds a lock), as a client or an index would."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.copies = 0

    def search(self, query: str) -> str:
        """Look the query up.

        Args:
            query: What to look up.
        """
        return query.upper()


class _SaysShared(Environment):
    def __init__(self) -> None:
        self.shared = True  # the user's own attribute of that name: not the class's list

    def step(self, turn: Turn) -> StepResult:
        return StepResult(done=True)


def test_a_tools_object_is_shared_by_the_episodes_and_shared_is_read_from_the_class():
    """tools=[index.search]: the episodes' copies call the one index (it could not be copied); an
    environment's own attribute named `shared` is not taken for the list of shared attributes."""
    from lightning_ppo.rollout.episodes import copy_for_an_episode
    from lightning_ppo.rollout.tools import ToolEnvironment

    index = _Index()
    environment = ToolEnvironment([index.search])
    copied = copy_for_an_episode(environment)
    assert copied.tools["search"].__self__ is index
    assert copy_for_an_episode(_SaysShared()).shared is True

    class Misspelt(Environment):
        shared = "lock"  # a string, not a tuple

    with pytest.raises(UsageError, match=r"Misspelt.shared must be a tuple of attribute names"):
        copy_for_an_episode(Misspelt())
