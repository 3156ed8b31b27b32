"""A message appended after a reply, in the tokenizer's own chat template.

In a multi-turn episode with a chat model, what answers the policy (an environment, a tool) is a
chat message, not free text: the template wraps it in its role markers and opens the assistant's
next turn. The template is rendered once for a conversation without the message and once with it;
the text between the end of the reply (its stop token, which the policy sampled itself) and the
end of the second rendering is what follows the reply. Templates render whole conversations only,
so this is how multi-turn trainers (verl, SkyRL) get the same delta.
"""

from __future__ import annotations

from typing import Any

from lightning_ppo.runs.errors import UsageError

_CONTENT, _REPLY = "\x00CONTENT\x00", "\x00REPLY\x00"


def message_suffix(tokenizer: Any, role: str, stop_token: str | None, **fields: str) -> str:
    """What the chat template writes after an assistant reply's stop token for one ``role`` message
    and the next assistant turn's opening, with ``{content}`` where the message's content goes
    (``str.format``; other braces are escaped)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError(f"a {role!r} message needs a tokenizer with a chat template; this one has none")
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _REPLY}]
    message = {"role": role, "content": _CONTENT, **fields}
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template([*base, message], tokenize=False, add_generation_prompt=True)
    stop = stop_token or tokenizer.eos_token
    start = before.index(_REPLY) + len(_REPLY)
    end_of_reply = before.index(stop, start) + len(stop) if stop and stop in before[start:] else start
    if not after.startswith(before[:end_of_reply]) or _CONTENT not in after:
        raise UsageError(f"the tokenizer's chat template does not render a {role!r} message after a reply")
    suffix = after[end_of_reply:]
    return suffix.replace("{", "{{").replace("}", "}}").replace(_CONTENT, "{content}")


class MessageRenderer:
    """Renders observations given as chat messages (``{"role": ..., "content": ...}``), one template
    rendering per role, cached."""

    def __init__(self, tokenizer: Any, stop_token: str | None) -> None:
        self.tokenizer, self.stop_token = tokenizer, stop_token
        self._suffixes: dict[str, str] = {}

    def __call__(self, message: dict[str, str]) -> str:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("content"), str)
            or "role" not in message
        ):
            raise UsageError(
                f"an observation message must be {{'role': ..., 'content': str}}, got {message!r}"
            )
        role = message["role"]
        if role not in self._suffixes:
            self._suffixes[role] = message_suffix(self.tokenizer, role, self.stop_token)
        return self._suffixes[role].format(content=message["content"])
