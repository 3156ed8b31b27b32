"""One generation server, as the trainer talks to it: JSON over HTTP, every call bounded in time.

A server that is down, dies mid-run, hangs, or answers with an error status gives one
:class:`GenerationServerError` naming its URL and the route, within ``timeout`` seconds: peers'
syncs that waited forever on a hung server without a word (trl#6796, trl#6797) are the reason.
These calls (checks, syncs, worker calls: a few per iteration) use the standard library, the
whole exchange within the timeout however its bytes trickle in (:mod:`.deadline`); a
batch's completions go over pooled connections on the engine's event loop
(:mod:`.session`), with the same messages (the ``what`` functions below).

Every call carries the server's API key as a bearer token: ``VLLM_API_KEY`` where it is set, else
the key ``lightning-ppo serve`` made for the server and wrote to a file only its user can read,
named by the server's address (:mod:`lightning_ppo.runs.server_keys`). Never from a config file,
which would copy it into every run's saved ``config.yaml``. A refused key is said in one line: none
found (and where it was looked for), the variable's, or a key file's left by an earlier server.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any

from lightning_ppo.rollout.engines.server.deadline import ErrorStatus, exchange
from lightning_ppo.runs.errors import UsageError
from lightning_ppo.runs.server_keys import API_KEY_VARIABLE, ServerKey, environment_key, server_key


class GenerationServerError(UsageError, RuntimeError):
    """A generation server could not be reached, did not answer in time, refused a call, or serves
    something the trainer cannot use. Printed as one line by ``lightning-ppo``; ``what`` is the
    message without the server's URL and route (to build another message on it, saying them once)."""

    def __init__(self, message: str, what: str | None = None) -> None:
        super().__init__(message)
        self.what = message if what is None else what


class ServerClient:
    """Calls to the vLLM server at ``url`` (``http://HOST:PORT``), each within ``timeout`` seconds."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._file_key: ServerKey | None = None  # read once found (every request would read it)

    def get(self, route: str) -> Any:
        return self._call(
            urllib.request.Request(self.url + route, headers=self.auth_headers()), route, self.timeout
        )

    def post(
        self, route: str, body: dict[str, Any] | None = None, timeout: float | None = None, what: str = ""
    ) -> Any:
        """``timeout``: the socket's limit for this call, where it is longer than ``self.timeout`` (a
        call queued behind others; a batch of them is bounded by :mod:`.batch`). ``what``
        follows the route in an error (the worker method of a ``/collective_rpc``)."""
        data = json.dumps(body or {}).encode()
        headers = {"Content-Type": "application/json", **self.auth_headers()}
        request = urllib.request.Request(self.url + route, data=data, headers=headers, method="POST")
        return self._call(request, f"{route} {what}".strip(), timeout or self.timeout)

    def rpc(self, method: str, *args: str) -> Any:
        """A call of the worker extension's ``method`` (:mod:`.worker_extension`): the first worker's
        answer (the only one without tensor parallelism; for methods whose answers agree)."""
        return self.rpc_all(method, *args)[0]

    def rpc_all(self, method: str, *args: str, timeout: float | None = None) -> list[Any]:
        """Every worker's answer to ``method``, in the server's worker order (one per TP rank).
        ``timeout``: for a method that itself waits up to ``self.timeout`` (a join of the weights
        group), a longer bound, so that the worker's own error comes back rather than the call's."""
        body = {"method": method, "args": list(args), "timeout": timeout or self.timeout}
        answer = self.post("/collective_rpc", body, timeout=timeout and timeout + self.timeout, what=method)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not results:
            raise self.error(f"/collective_rpc {method}", f"no result in {str(answer)[:200]!r}")
        return results

    def error(self, route: str, what: str) -> GenerationServerError:
        return GenerationServerError(f"generation server {self.url} ({route}): {what}", what)

    def key(self) -> ServerKey:
        """The server's key: ``VLLM_API_KEY`` (read at every call, as before), else its key file's."""
        if self._file_key is not None and environment_key() is None:
            return self._file_key
        key = server_key(self.url)
        if key.source not in (None, API_KEY_VARIABLE):
            self._file_key = key
        return key

    def key_changed(self, sent: str | None) -> bool:
        """After a 401 to a call that carried the key ``sent``: the key file read again, and true
        where it now holds another key: a server restarted at this address by ``lightning-ppo
        serve`` wrote its new one while this run held the old. The call goes again once with it
        (the run then hears what happened, from the version check: restarted), rather than be
        refused as a stale file's. Compared with the key the call sent, not the one held now:
        another call of a batch may have read the new one meanwhile."""
        if environment_key() is not None:
            return False
        self._file_key = None
        return self.key().value not in (None, sent)

    def auth_headers(self) -> dict[str, str]:
        """The bearer token of :meth:`key`, where there is one."""
        key = self.key().value
        return {"Authorization": f"Bearer {key}"} if key else {}

    def refused(self, status: int, body: bytes) -> str:
        """What an error status says; a 401 says which key was refused, or where none was found."""
        return refused(status, body, self.key() if status == 401 else None)

    def answer(self, route: str, body: bytes) -> Any:
        """A call's answer: its JSON (``None`` where empty), or one error naming the server."""
        if not body:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            raise self.error(route, not_json(body)) from None

    def _call(self, request: urllib.request.Request, route: str, timeout: float, again: bool = True) -> Any:
        try:  # the whole exchange within the timeout, not each read (a trickling server)
            body = exchange(request, timeout)
        except ErrorStatus as err:
            sent = request.get_header("Authorization", "").removeprefix("Bearer ") or None
            if err.status == 401 and again and self.key_changed(sent):
                for name, value in self.auth_headers().items():
                    request.add_header(name, value)
                return self._call(request, route, timeout, again=False)
            raise self.error(route, self.refused(err.status, err.body)) from None
        except TimeoutError:
            raise self.error(route, no_answer(timeout)) from None
        except http.client.HTTPException as err:  # IncompleteRead, a malformed status line...
            raise self.error(route, broke_off(err)) from None
        except (urllib.error.URLError, ConnectionError, OSError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, TimeoutError | socket.timeout):
                raise self.error(route, no_answer(timeout)) from None
            raise self.error(route, unreachable(reason)) from None
        return self.answer(route, body)


# What went wrong, as every call says it (after the server's URL and route).


def refused(status: int, body: bytes, key: ServerKey | None = None) -> str:
    """``key``: the key a refused call (HTTP 401) carried, and where it came from."""
    return f"HTTP {status}: {_message(body)}{_unauthorized(key) if status == 401 else ''}"


def _unauthorized(key: ServerKey | None) -> str:
    if key is None:
        return f" (the server wants an API key: set {API_KEY_VARIABLE} to it)"
    if key.source == API_KEY_VARIABLE:
        return f" (it refused the key in {API_KEY_VARIABLE}: set it to this server's key)"
    if key.source is not None:
        return (
            f" (it refused the key in {key.source}: a stale key of an earlier server at this address? "
            f"Start the server again with `lightning-ppo serve`, or set {API_KEY_VARIABLE} to its key)"
        )
    return (
        f" (the server wants an API key: {API_KEY_VARIABLE} is unset and there is no key file "
        f"{key.expected}, which `lightning-ppo serve` writes for the URL it prints; set "
        f"{API_KEY_VARIABLE} to the server's key)"
    )


def no_answer(timeout: float) -> str:
    return f"no answer within {timeout:g} s (generation.server_timeout)"


def broke_off(err: BaseException) -> str:
    return f"broke off its answer ({type(err).__name__}: {err})"


def unreachable(reason: object) -> str:
    return f"unreachable ({reason}); is it running? Start one with `lightning-ppo serve`"


def not_json(body: bytes) -> str:
    return f"answered with something other than JSON: {body[:200]!r}"


def api_key() -> str | None:
    """``VLLM_API_KEY`` (:func:`~lightning_ppo.runs.server_keys.environment_key`)."""
    return environment_key()


def auth_headers() -> dict[str, str]:
    """The bearer token of ``VLLM_API_KEY``, where it is set (one server's key, its file's too:
    :meth:`ServerClient.auth_headers`)."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def _message(body: bytes) -> str:
    """The error message of a vLLM error answer (``{"error": {"message": ...}}`` or ``{"detail": ...}``),
    on one line: a traceback or a proxy's HTML page runs over many, and the run's error is one."""
    try:
        answer = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return one_line(body[:4000].decode(errors="replace"), 300)
    if isinstance(answer, dict):
        error = answer.get("error")
        if isinstance(error, dict) and "message" in error:
            return one_line(str(error["message"]), 500)
        if "detail" in answer:
            return one_line(str(answer["detail"]), 500)
        if error:
            return one_line(str(error), 500)
    return one_line(str(answer), 300)


def one_line(text: str, limit: int) -> str:
    """``text`` with every run of white space (line ends, tabs) one space, cut to ``limit``
    characters with an ellipsis where it was longer."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"
