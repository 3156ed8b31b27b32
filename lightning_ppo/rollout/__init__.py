"""Generation: what turns a batch of prompts into a rollout.

``prompts`` (the batch it starts from), ``sampling`` (Hugging Face ``generate`` and the stop-token
masks), ``compiled_decoding`` (``generation.compile``: its decoding steps compiled), ``engines/``
(``hf`` and the colocated ``vllm`` engine, and the weights they are given),
``episodes`` (multi-turn episodes against an ``environment``, whose answers ``answers`` checks;
``kept_cache`` for ``hf``), ``tools``, ``chat`` and ``vocab``.
May import ``ppo/``, ``distributed/``, ``runs/`` and ``config``; never ``watch/`` or the public face
(episode metrics are ``EpisodeStats.metrics``, which ``watch/`` reads).

``lightning_ppo.rollout`` was one module before it was a folder; its names still import from here.
"""

from lightning_ppo._moved import forwarding

__getattr__ = forwarding(
    __name__,
    {
        "Rollout": "lightning_ppo.ppo.rollout_data",
        "position_ids_from_mask": "lightning_ppo.ppo.rollout_data",
        **dict.fromkeys(
            (
                "truncate_at_stop",
                "hf_generation_config",
                "weights_cast_once",
                "cache_for",
                "OneDtypeStaticCache",
                "generate",
            ),
            "lightning_ppo.rollout.sampling",
        ),
    },
)
