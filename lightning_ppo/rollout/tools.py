"""Tools: plain Python functions the policy calls inside a multi-turn episode.

``model.tools: [my_pkg.calculator, ...]`` makes every episode a conversation with them. After each
reply, :class:`ToolEnvironment` looks for a call; the function's result (or what went wrong)
comes back as the observation and the policy goes on. A reply without a call ends the episode
(or, with ``model.environment`` set as well, is that environment's turn). Two call formats:

``hermes`` (for tokenizers with a chat template: the format Hugging Face chat templates that take
``tools`` expect, as Qwen and Hermes models emit it)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>

The result comes back as a ``tool`` message rendered by the tokenizer's own chat template.

``text`` (any tokenizer; the tiny char-level ones have no braces or quotes)::

    call calculator: 12*7

The function receives the text after the colon as its one argument; the observation is
``result: 84;``. In both formats a malformed call, an unknown name or a function that raises
becomes an observation saying so (``error: ...;`` or a ``tool`` message), counted in
``episode/tool_errors``: never a crash.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from lightning_ppo.rollout.chat import message_suffix
from lightning_ppo.rollout.environment import Environment, StepResult, Turn
from lightning_ppo.runs.bounded_calls import run_bounded
from lightning_ppo.runs.errors import UsageError

TOOL_FORMATS = ("auto", "hermes", "text")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# A text-format name is what the preamble advertises, a tool's __name__: any run of characters
# but spaces, ':' and ';' (capitals, digits, '_', '-', non-ASCII letters); the setup refuses others.
_TEXT_NAME = r"[^\s:;]+"
# A call starts a word: "recall f: x;" and "syscall f: y;" are words of the policy's, not calls.
_TEXT = re.compile(rf"(?<!\w)call ({_TEXT_NAME})\s*:\s*([^;]*)")
# Each tool call is a run_bounded of its own; its timed-out calls still running on their threads are
# bounded per tool over the whole run: past this many, a new call waits for one to end (until they
# are stuck: lightning_ppo.runs.call_threads).
_TOOL_LEFTOVERS = 64


@dataclass(frozen=True)
class ToolCall:
    """A call the policy wrote: the tool's name and its arguments (or why it could not be read)."""

    name: str
    arguments: dict[str, Any] | str
    error: str | None = None


class ToolEnvironment(Environment):
    """Answers each tool call with the tool's result; a reply without one ends the episode.

    Args:
        tools: The functions, by their ``__name__``.
        tool_format: ``hermes``, ``text``, or ``auto`` (``hermes`` when the tokenizer has a chat
            template, else ``text``).
        tokenizer: Renders ``tool`` messages with its chat template (``hermes``).
        stop_token: The text of the token that ends a reply (where the template's rendering of an
            assistant message ends and the tool message begins).
        inner: An environment for the turns that call no tool (its rewards and ``done``).
        timeout: Seconds a tool call may take (``episode.tool_timeout``; ``None``: no limit). A tool
            that takes longer answers the policy that it timed out, as one that raises does; an
            ``async def`` tool is awaited on the run's background loop.
    """

    def __init__(
        self,
        tools: list[Callable[..., Any]],
        tool_format: str = "auto",
        tokenizer: Any = None,
        stop_token: str | None = None,
        inner: Environment | None = None,
        timeout: float | None = None,
    ) -> None:
        if tool_format not in TOOL_FORMATS:
            raise UsageError(f"model.episode.tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
        for tool in tools:
            if not callable(tool) or not getattr(tool, "__name__", None):
                raise UsageError(f"model.tools entries must be named functions, got {tool!r}")
        self.tools = {tool.__name__: tool for tool in tools}
        has_template = getattr(tokenizer, "chat_template", None) is not None
        self.format = ("hermes" if has_template else "text") if tool_format == "auto" else tool_format
        if self.format == "text":
            _check_text_names(self.tools)
        if self.format == "hermes" and not has_template:
            raise UsageError("model.episode.tool_format hermes needs a tokenizer with a chat template")
        self.tool_suffix = message_suffix(tokenizer, "tool", stop_token) if self.format == "hermes" else None
        self.inner, self.timeout = inner, timeout
        self.calls = self.errors = 0

    def reset(self, prompt: str, row: dict[str, Any], rng: random.Random) -> Any:
        self.calls = self.errors = 0
        # an async inner reset returns its awaitable, which the runner awaits
        return self.inner.reset(prompt, row, rng) if self.inner is not None else None

    def step(self, turn: Turn) -> StepResult:
        call = self.parse(turn.text)
        if call is None:
            return self.inner.step(turn) if self.inner is not None else StepResult(done=True)
        self.calls += 1
        result, failed = self.run(call)
        self.errors += failed
        return StepResult(observation=self.render(call, result, failed))

    def parse(self, text: str) -> ToolCall | None:
        """The reply's first tool call, ``None`` if it makes none."""
        if self.format == "text":
            match = _TEXT.search(text)
            return ToolCall(match.group(1), match.group(2).strip()) if match else None
        match = _HERMES.search(text)
        if match is None:
            return None
        try:
            payload = json.loads(match.group(1))
            return ToolCall(str(payload["name"]), dict(payload.get("arguments") or {}))
        except (ValueError, KeyError, TypeError) as err:
            return ToolCall("", {}, f"malformed tool call ({type(err).__name__}: {err})")

    def own_words(self, reply: str) -> str:
        """``reply`` with each tool call written as its arguments only: the markup around them (the
        ``hermes`` tags, the JSON keys and the tool's name, ``call NAME:``) is every call's."""
        if self.format == "text":
            words = _TEXT.sub(lambda call: call.group(2).strip(), reply)
        else:
            words = _HERMES.sub(lambda call: _arguments_text(call.group(1)), reply)
        return self.inner.own_words(words) if self.inner is not None else words

    def run(self, call: ToolCall) -> tuple[str, bool]:
        """``(text, failed)``: the tool's result as text, or what went wrong."""
        if call.error is not None:
            return call.error, True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}", True
        arguments = call.arguments
        invoke = partial(tool, **arguments) if isinstance(arguments, dict) else partial(tool, arguments)
        # an async tool is awaited inside the guard too: a wrong argument name is its error, not a crash
        outcome = run_bounded([invoke], self.timeout, max_concurrency=1, leftovers=_TOOL_LEFTOVERS)[0]
        if outcome.timed_out:
            return f"{call.name} did not answer within {self.timeout} s", True
        if outcome.error is not None:  # a tool's failure is the policy's observation, not a crash
            return f"{call.name} raised {type(outcome.error).__name__}: {outcome.error}", True
        return str(outcome.value), False

    def render(self, call: ToolCall, result: str, failed: bool) -> str:
        if self.format == "text":
            return f" {'error' if failed else 'result'}: {result};"
        content = json.dumps({"error": result} if failed else {"name": call.name, "content": result})
        return self.tool_suffix.format(content=content)


def _arguments_text(payload: str) -> str:
    """A hermes call's argument values, space-separated; a call that does not parse, as written."""
    try:
        arguments = json.loads(payload).get("arguments") or {}
        return " ".join(str(value) for value in dict(arguments).values())
    except (ValueError, AttributeError, TypeError):
        return payload.strip()


def _check_text_names(tools: dict[str, Callable[..., Any]]) -> None:
    """Every tool can be called in the text format: its name is one the format reads back."""
    for name in tools:
        if not re.fullmatch(_TEXT_NAME, name):
            raise UsageError(
                f"model.tools: {name!r} cannot be called in the text format (`call NAME: ARGUMENT;`, "
                "a NAME without spaces, ':' or ';'): rename the function, or use episode.tool_format: "
                "hermes"
            )


@dataclass(frozen=True)
class PromptTools:
    """The tools a prompt should describe: what the data module renders into each prompt.

    ``hermes``: the functions go to the tokenizer's chat template (``apply_chat_template(...,
    tools=...)``), which writes their JSON schemas (read by transformers from each function's
    signature and Google-style docstring) where the model was trained to read them. ``text``:
    :meth:`preamble`, written before each prompt with ``data.tool_preamble: true``.
    """

    functions: tuple[Callable[..., Any], ...]
    format: str

    def schemas(self) -> list[dict[str, Any]]:
        """Each tool's JSON schema, as the chat template receives it; a function transformers cannot
        describe (no docstring, an argument without a type or without its line under ``Args:``) is
        one line naming it."""
        from transformers.utils import get_json_schema

        schemas = []
        for function in self.functions:
            try:
                schemas.append(get_json_schema(function))
            except Exception as err:  # transformers' TypeHintParsingException, DocstringParsingException
                raise UsageError(
                    f"model.tools: {function.__name__} cannot be described to the chat template: {err} "
                    "(give it type hints and a Google-style docstring with an Args: section)"
                ) from err
        return schemas

    def preamble(self) -> str:
        """The text-format tools in one line per tool, and how to call one."""
        lines = ["Tools (write `call NAME: ARGUMENT;` to call one, its result comes back):"]
        for function in self.functions:
            summary = (function.__doc__ or "").strip().splitlines()[:1]
            lines.append(f"- {function.__name__}: {summary[0] if summary else ''}".rstrip(": "))
        return "\n".join(lines) + "\n"


def tool_counts(environment: Environment) -> tuple[int, int]:
    """``(calls, errors)`` of an episode's tools; ``(0, 0)`` for an environment without tools."""
    if not isinstance(environment, ToolEnvironment):
        return 0, 0
    return environment.calls, environment.errors


def prompt_tools(environment: Environment | None) -> PromptTools | None:
    """What the prompts should describe when ``environment`` is the tools' (``None`` otherwise)."""
    if not isinstance(environment, ToolEnvironment):
        return None
    return PromptTools(tuple(environment.tools.values()), environment.format)
