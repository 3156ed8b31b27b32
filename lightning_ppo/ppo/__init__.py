"""The PPO algorithm as pure math and the update's data, apart from Lightning.

``functional`` (log-probs, GAE, the losses, whitening), ``kl`` (estimators and controllers),
``rollout_data`` (the sampled rollout), ``experience`` (what one iteration trains on),
``microbatches`` and ``row_groups`` (cutting it for the update), ``optim`` (the optimizer's step and
clip), ``param_groups`` (the critic's own group, lr and clip),
``compiled_loss`` (the loss pass under ``torch.compile``, compiled once).
Imports nothing of the package but ``lightning_ppo.config`` (and ``runs.errors`` through it): the
math can be read, tested and reused without a Trainer, a model or a generation engine.
"""
