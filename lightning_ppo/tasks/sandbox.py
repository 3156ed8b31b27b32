"""The reveal task with an environment that calls out: each answer comes from a process.

:class:`SandboxReveal` is :class:`~lightning_ppo.tasks.reveal.RevealDigits` whose observation is
printed by a subprocess that first waits ``delay`` seconds (``sh -c "sleep 0.05; echo 47192"``), a
stand-in for a code sandbox, a web tool or a game server. Its ``reset`` and ``step`` are
``async def``: a batch's 64 episodes wait for their 64 processes together, so a turn costs about
one ``delay``, not 64 (``episode.step_timeout`` bounds each). ``configs/sandbox.yaml`` trains it.
"""

from __future__ import annotations

import asyncio
import random
import shlex
from typing import Any

from lightning_ppo.rollout.episodes import StepResult, Turn
from lightning_ppo.tasks.reveal import RevealDigits


class SandboxReveal(RevealDigits):
    """Reveals the row's ``target`` through a subprocess that takes ``delay`` seconds.

    Args:
        delay: Seconds the process waits before it answers.
        in_order: As for :class:`RevealDigits`.
    """

    def __init__(self, delay: float = 0.05, in_order: bool = False) -> None:
        super().__init__(in_order)
        self.delay = delay

    async def reset(self, prompt: str, row: dict[str, Any], rng: random.Random) -> None:
        super().reset(prompt, row, rng)

    async def step(self, turn: Turn) -> StepResult:
        if turn.index > 0:
            return super().step(turn)
        command = f"sleep {self.delay}; echo {shlex.quote(self.target)}"
        process = await asyncio.create_subprocess_exec(
            "sh", "-c", command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await process.communicate()
        if process.returncode:
            raise RuntimeError(f"the sandbox exited with {process.returncode}: {err.decode().strip()}")
        return StepResult(observation=f"{out.decode().strip()}=")
