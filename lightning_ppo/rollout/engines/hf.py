"""The default engine: Hugging Face ``generate`` on the trained policy module itself."""

from __future__ import annotations

import transformers
from torch import Tensor, nn

from lightning_ppo.ppo.rollout_data import Rollout
from lightning_ppo.rollout.sampling import generate


class HFEngine:
    """Generates with the live policy, so syncing only remembers which module that is (no copy).

    With ``generation.compile`` (a ``compile_config`` in ``generation_config``) the decoding steps run
    compiled (``rollout/compiled_decoding.py``); what that keeps, the static caches of each shape and
    the compiled call, is kept on the policy itself, so an engine made per job (``ppo.max_staleness``
    snapshots) finds it again.
    """

    def __init__(self, generation_config: transformers.GenerationConfig, cache: str = "static") -> None:
        self.generation_config, self.cache = generation_config, cache
        self.policy: nn.Module | None = None

    def sync_weights(self, policy: nn.Module) -> None:
        self.policy = policy

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Rollout:
        if self.policy is None:
            raise RuntimeError("HFEngine.generate before sync_weights: no policy to generate with")
        return generate(self.policy, prompt_ids, prompt_mask, self.generation_config, self.cache)
