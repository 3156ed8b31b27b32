"""Watching a run: the metrics logged each iteration (``metrics``), how varied the answers are
(``diversity``), the guardrails that say when training goes wrong (``guardrails``), sample tables
(``samples``), ``lightning-ppo plot`` (``plot``) and offline W&B runs (``wandb_offline``). Reads
``ppo/`` and ``config``; nothing below it imports it.
"""
