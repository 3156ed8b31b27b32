"""Tools: calls in both formats, results and failures as observations (never a crash), counted."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from transformers import AutoTokenizer

from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule
from lightning_ppo.config import EpisodeConfig
from lightning_ppo.rollout.episodes import StepResult, Turn
from lightning_ppo.rollout.tools import ToolCall, ToolEnvironment
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.tasks.arithmetic import AnswerReward, ArithmeticDataModule, calculator
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint
from lightning_ppo.watch.diversity import Diversity
from lightning_ppo.watch.guardrails import _converged_on

CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def broken(x: str) -> str:
    raise RuntimeError("out of paper")


def lookup(key: str) -> str:
    return key.upper()


async def lookup_async(key: str) -> str:
    return key.upper()


@pytest.mark.parametrize("tool", [lookup, lookup_async], ids=["def", "async def"])
def test_a_call_with_a_wrong_argument_name_is_an_error_observation_for_plain_and_async_tools(tool):
    env = ToolEnvironment([tool], tool_format="text")
    name = tool.__name__
    assert env.run(ToolCall(name, {"key": "x"})) == ("X", False)
    text, failed = env.run(ToolCall(name, {"query": "x"}))
    assert failed and text.startswith(f"{name} raised TypeError: ") and "'query'" in text


def _turn(text: str, index: int = 0) -> Turn:
    return Turn(index, text, [], True)


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculator("12*7") == "84" and calculator(" 7/2 ") == "3.5" and calculator("-3+5") == "2"
    with pytest.raises(ValueError, match="not arithmetic"):
        calculator("__import__('os')")


def test_text_calls_return_results_and_failures_as_observations_counted():
    env = ToolEnvironment([calculator, broken], tool_format="text")
    env.reset("what is 12*7? ", {}, random.Random(0))
    assert env.step(_turn("let me see. call calculator: 12*7")) == StepResult(observation=" result: 84;")
    assert env.step(_turn("call calculator: 12*x")).observation.startswith(" error: calculator raised")
    assert (
        env.step(_turn("call broken: 1")).observation == " error: broken raised RuntimeError: out of paper;"
    )
    assert (
        env.step(_turn("call abacus: 1")).observation
        == " error: unknown tool 'abacus'; tools: broken, calculator;"
    )
    assert (env.calls, env.errors) == (4, 3)
    assert env.step(_turn("84")) == StepResult(done=True)  # no call: the episode's answer
    env.reset("again", {}, random.Random(0))
    assert (env.calls, env.errors) == (0, 0)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A char-level tokenizer whose alphabet can spell JSON, with a small ChatML-like chat template."""
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz <>{}[]\"':,._*+-/=?|"
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("chat"), TinyModelSpec(), alphabet=alphabet)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHATML
    return tokenizer


def test_hermes_calls_come_back_as_tool_messages_of_the_chat_template(chat_tokenizer):
    env = ToolEnvironment([calculator], tool_format="auto", tokenizer=chat_tokenizer)
    assert env.format == "hermes"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    result = env.step(_turn(call))
    # what the template writes after the reply's <eos>: the tool message, then the assistant's turn
    assert result.observation == '<|tool|>{"name": "calculator", "content": "84"}<eos><|assistant|>'
    malformed = env.step(_turn("<tool_call>{name: calculator}</tool_call>")).observation
    assert malformed.startswith('<|tool|>{"error": "malformed tool call (JSONDecodeError')
    assert (env.calls, env.errors) == (2, 1)


def test_tool_settings_are_checked(chat_tokenizer, tiny_digits):
    with pytest.raises(UsageError, match="hermes needs a tokenizer with a chat template"):
        ToolEnvironment(
            [calculator], tool_format="hermes", tokenizer=AutoTokenizer.from_pretrained(tiny_digits)
        )
    with pytest.raises(UsageError, match="model.tools entries must be named functions"):
        ToolEnvironment(["calculator"], tool_format="text")
    with pytest.raises(UsageError, match="episode.tool_format must be one of"):
        EpisodeConfig(tool_format="xml")


def test_a_run_with_tools_counts_calls_in_its_metrics(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "chars", TinyModelSpec())
    torch.manual_seed(0)
    module = PPOLightningModule(
        policy=str(path),
        reward_fn=AnswerReward(),
        tools=[calculator],
        episode=EpisodeConfig(max_turns=2, max_tokens=48, tool_format="text"),
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=20),
    )
    data = ArithmeticDataModule(num_prompts=32, batch_size=8, max_prompt_length=24)
    data.set_tokenizer(module.tokenizer)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    module.generate(batch)
    metrics = module.episode_runner.metrics()
    assert metrics["episode/turns_mean"].item() >= 1.0
    assert metrics["episode/tool_calls"].item() >= metrics["episode/tool_errors"].item() >= 0


# ----------------------------------------------------------------- tools described in the prompt
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}<eos>{% endif %}" + CHATML
)


def lookup(key: str) -> str:
    """look up a key.

    Args:
        key: the key to look up
    """
    return key[::-1]


def no_docstring(key: str) -> str:
    return key


def nothing(prompts, completions, batch):
    return [0.0] * len(completions)


def test_hermes_tools_reach_the_prompt_through_the_chat_template(tmp_path):
    from lightning_ppo import PromptDataModule
    from tests.helpers import quiet_trainer

    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz <>{}[]\"':,._*+-/=?|"
    path = make_tiny_checkpoint(tmp_path / "chat", TinyModelSpec(n_positions=512), alphabet=alphabet)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(path)
    module = PPOLightningModule(
        policy=str(path),
        reward_fn=nothing,
        tools=[lookup],
        episode=EpisodeConfig(max_turns=2, max_tokens=40, tool_format="hermes"),
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=8),
    )
    assert module.prompt_tools.format == "hermes" and module.prompt_tools.functions == (lookup,)
    data = PromptDataModule(
        prompts=["what is abc? "] * 8, batch_size=8, chat_template=True, max_prompt_length=400
    )
    quiet_trainer(tmp_path, 1).fit(module, datamodule=data)  # the data module takes the module's tools
    prompt = data.format_prompt("what is abc? ")
    assert prompt.startswith('<|system|>{"type": "function", "function": {"name": "lookup", ')
    assert '"description": "look up a key."' in prompt and '"description": "the key to look up"' in prompt
    assert prompt.endswith("<|user|>what is abc? <eos><|assistant|>")


def test_a_tool_the_template_cannot_describe_is_one_line_naming_it():
    from lightning_ppo.rollout.tools import PromptTools

    with pytest.raises(
        UsageError, match=r"^model.tools: no_docstring cannot be described to the chat template"
    ):
        PromptTools((no_docstring,), "hermes").schemas()


def test_text_tools_get_a_preamble_when_asked(chat_tokenizer):
    from lightning_ppo import PromptDataModule
    from lightning_ppo.rollout.tools import PromptTools

    tools = PromptTools((calculator, lookup), "text")
    assert tools.preamble() == (
        "Tools (write `call NAME: ARGUMENT;` to call one, its result comes back):\n"
        "- calculator: Evaluate an arithmetic expression of numbers, +, -, * and / (no names, no calls).\n"
        "- lookup: look up a key.\n"
    )
    data = PromptDataModule(prompts=["2*3="], tool_preamble=True)
    data.tools = tools
    assert data.format_prompt("2*3=") == tools.preamble() + "2*3="
    data.tool_preamble = False
    assert data.format_prompt("2*3=") == "2*3="


def _named(name: str):
    def tool(argument: str) -> str:
        return f"{name}({argument})"

    tool.__name__ = name
    return tool


def test_text_calls_reach_tools_named_with_capitals_digits_underscores_and_dashes():
    """The preamble advertises each tool by its ``__name__``; ``call getWeather: Paris;`` was no call
    at all (names were lower case only), and the episode just ended."""
    names = ["getWeather", "lookup_v2", "get-weather", "Größe", "_private"]
    env = ToolEnvironment([_named(name) for name in names], tool_format="text")
    for name in names:
        assert env.parse(f"so: call {name}: Paris; then") == ToolCall(name, "Paris")
        assert env.step(_turn(f"call {name}:Paris;")) == StepResult(observation=f" result: {name}(Paris);")
    assert (env.calls, env.errors) == (len(names), 0)


def test_a_text_call_starts_a_word_not_inside_one():
    """``call NAME:`` was found inside words: "recall getWeather: x;" and "syscall f: y;" called the
    tools (and their markup left the policy's own words). A call starts the text or follows a
    character that is no letter, digit or '_'."""
    env = ToolEnvironment([_named("getWeather"), _named("f")], tool_format="text")
    for words in ["recall getWeather: x;", "syscall f: y;", "Recall f: y", "_call f: y;", "2call f: y;"]:
        assert env.parse(words) is None, words
        assert env.own_words(words) == words
        assert env.step(_turn(words)) == StepResult(done=True)
    assert (env.calls, env.errors) == (0, 0)
    calls = ["call f: y;", "so:call f: y;", "(call f: y;)", "x\ncall f: y", "recall f: x; then call f: y;"]
    for words in calls:
        assert env.parse(words) == ToolCall("f", "y"), words
    assert env.own_words("recall f: x; then call f: y;") == "recall f: x; then y;"


@pytest.mark.parametrize("name", ["get weather", "a:b", "a;b"])
def test_a_tool_name_the_text_format_cannot_call_is_one_line_at_setup(name):
    said = rf"^model.tools: {re.escape(repr(name))} cannot be called in the text format \(`call NAME: "
    with pytest.raises(UsageError, match=said):
        ToolEnvironment([_named(name)], tool_format="text")


# ----------------------------------------------------------------- the policy's own words
def _hermes_episode(i: int) -> tuple[list[str], str]:
    """A correct, distinct hermes episode: the policy's two replies, and the tool message between them
    as the chat template writes it (what the episode's text holds between the replies)."""
    a, b = i + 3, i + 7
    call = {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
    result = {"name": "calculator", "content": str(a * b)}
    replies = [f"<tool_call>{json.dumps(call)}</tool_call>", f"so {a} times {b} is {a * b}"]
    return replies, f" user <tool_response>{json.dumps(result)}</tool_response> assistant "


def test_a_replys_own_words_leave_out_the_tool_call_wrapper(chat_tokenizer):
    """What the diversity checks compare: the policy's words, not the call's markup (the run's
    observations are left out by the runner). Before, 16 correct, distinct hermes episodes read as
    near-copies sharing '"}} </tool_call> user <tool_response> ...' (overlap 0.78)."""
    hermes = ToolEnvironment([calculator], tool_format="hermes", tokenizer=chat_tokenizer)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    assert hermes.own_words(f"let me see. {call}") == "let me see. 12*7"
    assert hermes.own_words("<tool_call>{name: calculator}</tool_call>") == "{name: calculator}"  # malformed
    text = ToolEnvironment([calculator], tool_format="text")
    assert text.own_words("let me see. call calculator: 12*7; then") == "let me see. 12*7; then"
    assert text.own_words("84") == "84"
    prompts = [f"question {i}" for i in range(16)]
    episodes = [_hermes_episode(i) for i in range(16)]
    whole = Diversity.of(prompts, [replies[0] + between + replies[1] for replies, between in episodes])
    assert _converged_on(whole) is not None  # the wrappers and the tool messages, read as the answer
    own = Diversity.of(prompts, [" ".join(map(hermes.own_words, replies)) for replies, _ in episodes])
    assert _converged_on(own) is None
