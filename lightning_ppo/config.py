"""Typed hyper-parameters of a PPO run.

Each dataclass validates itself in ``__post_init__`` so a bad value fails before any model is
loaded, with a ``UsageError`` (a ``ValueError``) that names the field and the allowed range.
LightningCLI reads the ``Args:`` sections below as the ``--help`` text of every option.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_ppo.runs.errors import UsageError

_KL_ESTIMATORS = ("k1", "k2", "k3")
ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp")
_KL_PLACEMENTS = ("reward", "loss")
_BAD_REWARD_POLICIES = ("error", "drop")
_ENGINES = ("hf", "vllm", "vllm_server")
_CACHES = ("static", "dynamic")
_IS_LEVELS = ("token", "sequence")


def _check(condition: bool, field: str, expected: str, value: object) -> None:
    if not condition:
        raise UsageError(f"{field} must be {expected}, got {value!r}")


@dataclass
class GenerationConfig:
    """How responses are sampled during a rollout.

    Args:
        max_new_tokens: Maximum number of tokens generated per response (>= 1).
        temperature: Sampling temperature (> 0). Log-probs are computed at the same temperature.
        top_k: Keep only the k most likely tokens when sampling; 0 disables it.
        top_p: Nucleus sampling threshold in (0, 1]; 1.0 disables it.
        stop_token: Text of the token that ends a response. ``None`` means the tokenizer's EOS.
            Everything after the first stop token is padding.
        forward_chunk_size: Bounds the rollout forwards' memory (policy, reference, value, reward
            model): each runs on at most this many sequences' padded tokens; 0 means no bound.
            The forwards always run on groups of similar-length rows without the padding they
            share (lightning_ppo.ppo.row_groups).
        eval_do_sample: Validation samples like training instead of decoding greedily.
        suppress_tokens: Tokens never sampled, as token strings (looked up in the tokenizer's
            vocabulary), ids, or patterns: a string that is not a token and holds ``*`` (any run of
            characters) or ``?`` (one character) suppresses every vocabulary token it matches, e.g.
            ``"[unused*]"`` (every other character is literal, ``[`` included). A pattern matching
            no token is an error. Log-probs are computed under the same masked distribution.
        engine: What samples rollouts: ``hf`` (Hugging Face ``generate`` on the policy) or
            ``vllm`` (an in-process vLLM engine per rank, weights pushed from the policy every
            iteration; needs the ``vllm`` extra) or ``vllm_server`` (running vLLM servers, started with
            ``lightning-ppo serve``, at ``server_urls``; weights synced to every server every
            iteration). Validation always decodes with ``hf``.
        engine_is_correction: Truncated importance sampling for the engine-vs-trainer log-prob
            mismatch: ``token`` or ``sequence`` weights min(exp(logp_trainer - logp_engine), C)
            multiply the policy loss; ``null`` (default) applies none. Needs a vLLM engine.
        engine_is_cap: The truncation C of those weights (> 0).
        gpu_memory_utilization: vLLM's share of the accelerator's memory for weights and KV cache
            (on CPU it sizes the KV cache from the machine's memory instead).
        gather_for_generation: Under FSDP2, keep the policy's blocks gathered through a whole ``generate``
            (rollouts and validation): one all-gather per block per reply instead of one per block per
            token. It costs the policy's whole unsharded weights on every rank while it generates
            (the gathered copy is freed after). ``false`` gathers each block for each token's forward
            and frees it after, so a rank holds one block whole at a time: for a policy whose whole
            weights do not fit on one device, at one all-gather per block per generated token. No
            effect without FSDP2.
        cache_implementation: The key/value cache of HF ``generate``: ``static`` (default) writes
            each token into a cache allocated once for prompt + ``max_new_tokens``, and each step
            attends over the tokens written so far; ``dynamic`` grows the cache by concatenation,
            copying it whole at every token of every layer (measured on CPU: a third of a 128-token
            generation from 8-256-token prompts). The samples are the same; a model without
            static-cache support falls back to ``dynamic``. Never compiled by ``generate`` itself
            (``disable_compile``); see ``compile``.
        compile: Decode through ``torch.compile`` (inductor; CUDA graphs on a GPU): the ``hf``
            engine's rollouts, ``ppo.max_staleness`` snapshots and validation run their decoding
            steps as a compiled graph on a static cache kept between calls
            (``lightning_ppo/rollout/compiled_decoding.py``). The batch is padded to the next power of
            two of its rows and the cache sized to ``max_new_tokens`` plus the prompt width rounded up
            to a power of two, so a run compiles once per such shape (once for fixed-width prompts);
            each shape's cache stays allocated through the update. A generation longer than a
            sliding-window model's window decodes eagerly. The prefill, the sampling and an
            ``episode.keep_cache`` cache run eagerly. Needs ``cache_implementation: static``; refused
            under FSDP2. Greedy tokens are eager's; sampled ones follow another random stream
            whenever the batch is padded.
        server_urls: The ``vllm_server`` engine's servers (``http://HOST:PORT``, as ``lightning-ppo
            serve`` prints it); each rank spreads its requests over all of them.
        server_max_in_flight: Requests in flight at once on each server, every rank's together
            (each rank sends at most its share to any one server: this / ranks, the remainder
            dealt out over the ranks, so the ranks together never exceed it); each
            request goes to the server with the fewest of its rank's in flight. The default, 256,
            is vLLM's default batch (``--max-num-seqs``) on most GPUs; set the servers' own where it
            differs (vLLM's default is 1024 on GPUs of 70 GiB or more but A100s, 128 on CPU).
        server_timeout: Seconds any one call to a server may take (a completion, a weight load, a
            check), and a batch's requests without any answer, before the run stops with an error
            naming the server.
        verify_sync: Check every weight sync against the trainer's weights (per-parameter checksums
            of what each server holds); the first sync is always checked.
        sync_dir: The folder the trainer writes the weights to for the servers to load (it must be
            the same path on the servers' machines); ``null`` is the system's temporary folder.
        sync_transport: How the weights reach the servers: ``memory`` (broadcast over a gloo group
            of the trainer and the servers' workers, no disk) or ``file`` (a safetensors file in
            ``sync_dir`` every server loads) or ``nccl`` (vLLM's own NCCL weight transfer, GPU to GPU:
            CUDA and vLLM on the trainer, servers started with ``lightning-ppo serve --nccl``).
        sync_address: Under ``memory``, the address the servers reach the trainer's rank 0 at (it
            listens on a free port there); ``null``: 127.0.0.1 when every server URL is on this
            machine, else this machine's name. A name is resolved once, on the trainer, to its IPv4
            address where it has one (``localhost``: 127.0.0.1), which rank 0 listens on and the
            servers are told, so both sides use one address.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token: str | None = None
    forward_chunk_size: int = 0
    eval_do_sample: bool = False
    suppress_tokens: list[str | int] = field(default_factory=list)
    engine: str = "hf"
    engine_is_correction: str | None = None
    engine_is_cap: float = 2.0
    gpu_memory_utilization: float = 0.3
    gather_for_generation: bool = True
    cache_implementation: str = "static"
    compile: bool = False
    server_urls: list[str] = field(default_factory=list)
    server_max_in_flight: int = 256
    server_timeout: float = 300.0
    verify_sync: bool = False
    sync_dir: str | None = None
    sync_transport: str = "memory"
    sync_address: str | None = None

    def __post_init__(self) -> None:
        _check(self.engine in _ENGINES, "generation.engine", f"one of {_ENGINES}", self.engine)
        self._check_servers()
        _check(
            self.engine_is_correction is None or self.engine_is_correction in _IS_LEVELS,
            "generation.engine_is_correction",
            f"one of {_IS_LEVELS} or null",
            self.engine_is_correction,
        )
        _check(
            self.engine_is_correction is None or self.engine != "hf",
            "generation.engine_is_correction",
            "null with generation.engine 'hf' (HF generate samples from the trained weights themselves)",
            self.engine_is_correction,
        )
        # vLLM's log-probs are renormalised over the tokens top_k/top_p keep, the trainer's are over
        # the whole vocabulary: each weight would be the kept mass (~0.9 a token at top_p 0.9), and
        # a sequence's product of them shrinks the policy gradient toward 0.
        _check(
            self.engine_is_correction is None or (self.top_k == 0 and self.top_p == 1.0),
            "generation.engine_is_correction",
            f"null while top-k/top-p sampling truncates (generation.top_k {self.top_k}, generation.top_p "
            f"{self.top_p}): the engine's log-probs are renormalised over the kept tokens, the trainer's not",
            self.engine_is_correction,
        )
        _check(self.engine_is_cap > 0, "generation.engine_is_cap", "> 0", self.engine_is_cap)
        _check(
            0 < self.gpu_memory_utilization <= 1,
            "generation.gpu_memory_utilization",
            "in (0, 1]",
            self.gpu_memory_utilization,
        )
        _check(
            self.cache_implementation in _CACHES,
            "generation.cache_implementation",
            f"one of {_CACHES}",
            self.cache_implementation,
        )
        _check(isinstance(self.compile, bool), "generation.compile", "true or false", self.compile)
        _check(
            not self.compile or self.cache_implementation == "static",
            "generation.compile",
            "false with generation.cache_implementation 'dynamic' (compiled decoding writes a static cache)",
            self.compile,
        )
        _check(self.max_new_tokens >= 1, "generation.max_new_tokens", ">= 1", self.max_new_tokens)
        _check(self.temperature > 0, "generation.temperature", "> 0", self.temperature)
        _check(self.top_k >= 0, "generation.top_k", ">= 0 (0 disables it)", self.top_k)
        _check(0 < self.top_p <= 1, "generation.top_p", "in (0, 1]", self.top_p)
        _check(self.forward_chunk_size >= 0, "generation.forward_chunk_size", ">= 0", self.forward_chunk_size)
        for token in self.suppress_tokens:
            valid = isinstance(token, str) or (isinstance(token, int) and not isinstance(token, bool))
            _check(valid and token != "", "generation.suppress_tokens", "token strings or ids", token)

    def _check_servers(self) -> None:
        if self.engine != "vllm_server":
            return
        _check(
            bool(self.server_urls),
            "generation.server_urls",
            "one URL or more with generation.engine 'vllm_server' (`lightning-ppo serve` starts a server)",
            self.server_urls,
        )
        for url in self.server_urls:
            _check(
                isinstance(url, str) and url.startswith(("http://", "https://")),
                "generation.server_urls",
                "URLs like http://127.0.0.1:8000",
                url,
            )
        _check(self.server_timeout > 0, "generation.server_timeout", "> 0 seconds", self.server_timeout)
        _check(
            type(self.server_max_in_flight) is int and self.server_max_in_flight >= 1,
            "generation.server_max_in_flight",
            "an integer >= 1 (requests in flight per server)",
            self.server_max_in_flight,
        )
        _check(
            self.sync_transport in ("memory", "file", "nccl"),
            "generation.sync_transport",
            "'memory', 'file' or 'nccl'",
            self.sync_transport,
        )


@dataclass
class PPOConfig:
    """The PPO algorithm: losses, KL penalty, advantage estimation and the inner update loop.

    Args:
        advantage_estimator: ``gae`` (PPO with a critic), ``grpo`` (group mean/std normalised
            scores), ``rloo`` (leave-one-out baseline) or ``reinforce_pp`` (REINFORCE++: returns
            normalised over the batch). Only ``gae`` builds and trains a value model.
        num_generations: Completions sampled per prompt (group sampling); grpo and rloo need >= 2.
        ppo_epochs: Passes over each rollout batch per PPO iteration (>= 1).
        num_minibatches: Minibatches per epoch; the rollout batch must divide evenly into them.
        gradient_accumulation_steps: Micro-batches accumulated into each minibatch's optimizer step:
            equal counts of its sequences sorted by length. With 1 (the default) the minibatch still
            runs as micro-batches of similar-length sequences, as many as leave out padding worth
            an extra forward (lightning_ppo.ppo.row_groups; under FSDP2 as one).
        micro_batch_tokens: A token budget for those micro-batches: each one's rectangle (rows x
            (longest prompt + longest response)) stays within it (``null``: no bound). Either way
            each micro-batch is trimmed to its own longest prompt and response and weighed by its
            share of the minibatch's tokens, so the update is the unsplit minibatch's. Not with
            FSDP2 (its ranks must run equally many forwards).
        clip_range: Policy ratio clip epsilon (> 0).
        clip_range_low: The lower side of the clip, ``1 - low`` (> 0; ``None``: ``clip_range``).
        clip_range_high: The upper side of the clip, ``1 + high`` (> 0; ``None``: ``clip_range``).
            A larger ``high`` than ``low`` is DAPO's "clip-higher".
        loss_aggregation: How per-token policy (and in-loss KL) terms become the loss:
            ``token_mean`` (every token of the minibatch weighs the same; DAPO, TRL's default),
            ``sequence_mean`` (every response weighs the same; GRPO as published) or ``constant``
            (token sum over responses x the response length budget; Dr. GRPO).
        scale_rewards: What ``grpo`` divides a score's distance from its group mean by: ``group``
            (the group's std, GRPO), ``batch`` (the batch's std, every rank's) or ``none`` (Dr. GRPO).
        value_clip_range: Value prediction clip around the rollout values (> 0).
        vf_coef: Weight of the value loss in the total loss (>= 0).
        entropy_coef: Weight of the entropy bonus subtracted from the loss (>= 0).
        kl_coef: Initial coefficient of the per-token KL penalty in the reward (>= 0).
        kl_estimator: Per-token KL estimator: ``k1`` (log-ratio), ``k2`` or ``k3``.
        kl_placement: ``reward``: -kl_coef x KL is part of the per-token reward (PPO);
            ``loss``: kl_coef x KL is added to the loss, recomputed each minibatch (GRPO).
        kl_target: If set, the KL coefficient adapts toward this per-sequence KL (Ziegler et al.).
        kl_horizon: Horizon of the adaptive KL controller, in episodes (> 0): its slow part moves by at
            most 20 % x episodes / horizon per iteration. ``None``: 4 x the episodes of an iteration
            (every rank's), at most 5 % per iteration, 10x in 47 iterations.
        kl_coef_min: Lower bound of the adaptive KL coefficient (>= 0).
        kl_coef_max: Upper bound of the adaptive KL coefficient (> kl_coef_min); a run whose
            coefficient reaches a bound is warned once.
        gamma: Discount factor in [0, 1].
        gae_lambda: GAE lambda in [0, 1].
        whiten_advantages: Normalise advantages over the real response tokens of the batch.
        whiten_rewards: Normalise per-token rewards (without shifting the mean) before GAE.
        missing_eos_penalty: Subtracted from the score of responses that never emit the stop token.
        max_grad_norm: Clip the global gradient norm to this value; ``None`` disables clipping.
        critic_max_grad_norm: Clip the critic's gradient norm to this value apart from the policy's,
            which ``max_grad_norm`` then clips alone (verl's ``critic.grad_clip``); the critic gets a
            param group of its own (lightning_ppo.ppo.param_groups). ``None`` (default): one norm
            over the policy and the critic together, clipped to ``max_grad_norm``. Only with a critic.
        dual_clip: Dual-clip constant c > 1: the loss of a negative-advantage token is capped at -c A.
        score_clip: Clip scores to [-score_clip, score_clip] before the update uses them.
        score_norm: Normalise scores by a running mean and std over all iterations so far. With
            either, ``objective/scores`` still logs the reward's own scores and
            ``objective/scores_normalized`` the ones the update uses.
        on_bad_reward: ``error`` stops on a NaN/inf score; ``drop`` leaves that sample out of
            the update and counts it (``reward/dropped``).
        reward_timeout: Seconds an ``async def`` reward (an LLM judge, a reward server) may take for
            a batch (``None``: no limit). One that takes longer is handled as ``on_bad_reward``
            handles NaN: one line naming it, or its completions dropped and counted.
        max_consecutive_skips: An optimizer step with NaN/inf gradients is skipped and counted
            (``train/skipped_updates``); this many in a row (or this many iterations in a row whose
            every sample was dropped) stop training with an error.
        max_staleness: Generation runs this many batches ahead of training (asynchronous PPO): the
            rollout trained at iteration i was sampled by the weights of iteration i - max_staleness
            or later, while the updates between ran. 0 (default) samples each batch with the weights
            that train on it, as always. Above 0 the decoupled loss is on (the trainer's recomputed
            log-probs anchor the clip; each token's loss is weighted by min(exp(logp_trainer -
            logp_behaviour), generation.engine_is_cap), at generation.engine_is_correction's level,
            ``token`` unless set), and the first max_staleness steps only start sampling. Engines
            ``hf`` (a background thread samples from a snapshot of the policy; not under FSDP2) and
            ``vllm_server`` (1 at most). Batches sampled ahead and not yet trained are kept in every
            checkpoint and sampled again on resume: each prompt is trained exactly once.
        torch_compile: Run the policy and critic loss passes (forwards, log-probs, losses) through
            ``torch.compile`` (as ``TrainingArguments.torch_compile`` in transformers and TRL). The
            first iteration pays for compiling, once: every micro-batch shape, share and KL
            coefficient runs the same graph, LoRA and gradient checkpointing included
            (lightning_ppo.ppo.compiled_loss; counted in tests/test_compile_count.py); the losses
            match eager mode to float32 rounding (tests/test_compile.py).
    """

    advantage_estimator: str = "gae"
    num_generations: int = 1
    ppo_epochs: int = 4
    num_minibatches: int = 2
    gradient_accumulation_steps: int = 1
    micro_batch_tokens: int | None = None
    clip_range: float = 0.2
    clip_range_low: float | None = None
    clip_range_high: float | None = None
    loss_aggregation: str = "token_mean"
    scale_rewards: str = "group"
    value_clip_range: float = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    kl_placement: str = "reward"
    kl_target: float | None = None
    kl_horizon: float | None = None
    kl_coef_min: float = 0.001
    kl_coef_max: float = 10.0
    gamma: float = 1.0
    gae_lambda: float = 0.95
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    missing_eos_penalty: float | None = None
    max_grad_norm: float | None = 1.0
    critic_max_grad_norm: float | None = None
    dual_clip: float | None = None
    score_clip: float | None = None
    score_norm: bool = False
    on_bad_reward: str = "error"
    reward_timeout: float | None = 300.0
    max_consecutive_skips: int = 3
    max_staleness: int = 0
    torch_compile: bool = False

    @property
    def shapes_scores(self) -> bool:
        """Whether the update sees other scores than the reward's (clipped or normalised)."""
        return self.score_clip is not None or self.score_norm

    @property
    def uses_critic(self) -> bool:
        """Only GAE needs a value model; the other estimators build none."""
        return self.advantage_estimator == "gae"

    def __post_init__(self) -> None:
        _check(
            self.advantage_estimator in ADVANTAGE_ESTIMATORS,
            "ppo.advantage_estimator",
            f"one of {ADVANTAGE_ESTIMATORS}",
            self.advantage_estimator,
        )
        _check(self.num_generations >= 1, "ppo.num_generations", ">= 1", self.num_generations)
        if self.advantage_estimator in ("grpo", "rloo"):
            _check(
                self.num_generations >= 2,
                "ppo.num_generations",
                f">= 2 with advantage_estimator {self.advantage_estimator!r}",
                self.num_generations,
            )
        _check(
            self.kl_placement in _KL_PLACEMENTS,
            "ppo.kl_placement",
            f"one of {_KL_PLACEMENTS}",
            self.kl_placement,
        )
        _check(self.dual_clip is None or self.dual_clip > 1, "ppo.dual_clip", "> 1 or null", self.dual_clip)
        _check(
            self.score_clip is None or self.score_clip > 0, "ppo.score_clip", "> 0 or null", self.score_clip
        )
        _check(
            self.max_consecutive_skips >= 1, "ppo.max_consecutive_skips", ">= 1", self.max_consecutive_skips
        )
        _check(
            self.max_staleness >= 0, "ppo.max_staleness", ">= 0 (0: no generation ahead)", self.max_staleness
        )
        _check(
            self.reward_timeout is None or self.reward_timeout > 0,
            "ppo.reward_timeout",
            "> 0 or null",
            self.reward_timeout,
        )
        _check(
            self.on_bad_reward in _BAD_REWARD_POLICIES,
            "ppo.on_bad_reward",
            f"one of {_BAD_REWARD_POLICIES}",
            self.on_bad_reward,
        )
        _check(self.ppo_epochs >= 1, "ppo.ppo_epochs", ">= 1", self.ppo_epochs)
        _check(self.num_minibatches >= 1, "ppo.num_minibatches", ">= 1", self.num_minibatches)
        _check(
            self.gradient_accumulation_steps >= 1,
            "ppo.gradient_accumulation_steps",
            ">= 1",
            self.gradient_accumulation_steps,
        )
        _check(self.clip_range > 0, "ppo.clip_range", "> 0", self.clip_range)
        budget = self.micro_batch_tokens
        _check(budget is None or budget >= 1, "ppo.micro_batch_tokens", ">= 1 or null", budget)
        for name in ("clip_range_low", "clip_range_high"):
            value = getattr(self, name)
            _check(value is None or value > 0, f"ppo.{name}", "> 0 or null", value)
        aggregations = ("token_mean", "sequence_mean", "constant")
        _check(
            self.loss_aggregation in aggregations,
            "ppo.loss_aggregation",
            f"one of {aggregations}",
            self.loss_aggregation,
        )
        scales = ("group", "batch", "none")
        _check(self.scale_rewards in scales, "ppo.scale_rewards", f"one of {scales}", self.scale_rewards)
        _check(self.value_clip_range > 0, "ppo.value_clip_range", "> 0", self.value_clip_range)
        _check(self.vf_coef >= 0, "ppo.vf_coef", ">= 0", self.vf_coef)
        _check(self.entropy_coef >= 0, "ppo.entropy_coef", ">= 0", self.entropy_coef)
        _check(self.kl_coef >= 0, "ppo.kl_coef", ">= 0", self.kl_coef)
        _check(
            self.kl_estimator in _KL_ESTIMATORS,
            "ppo.kl_estimator",
            f"one of {_KL_ESTIMATORS}",
            self.kl_estimator,
        )
        # The gradient of E[log pi - log ref] under samples of pi is 0 (score-function identity),
        # so k1 in the loss does not pull toward the reference at all (measured: gradient norm
        # 0.0012 vs 0.461 for the true KL's). k2's gradient is the KL's; k3's is a different one.
        _check(
            not (self.kl_placement == "loss" and self.kl_estimator == "k1"),
            "ppo.kl_estimator",
            "k2 or k3 with ppo.kl_placement 'loss' (k1's expected gradient in the loss is 0)",
            self.kl_estimator,
        )
        _check(self.kl_target is None or self.kl_target > 0, "ppo.kl_target", "> 0 or null", self.kl_target)
        horizon = self.kl_horizon
        _check(horizon is None or horizon > 0, "ppo.kl_horizon", "> 0 or null", horizon)
        _check(self.kl_coef_min >= 0, "ppo.kl_coef_min", ">= 0", self.kl_coef_min)
        _check(
            self.kl_coef_max > self.kl_coef_min,
            "ppo.kl_coef_max",
            f"> ppo.kl_coef_min ({self.kl_coef_min})",
            self.kl_coef_max,
        )
        _check(
            self.kl_target is None or self.kl_coef_min <= self.kl_coef <= self.kl_coef_max,
            "ppo.kl_coef",
            f"within [ppo.kl_coef_min, ppo.kl_coef_max] = [{self.kl_coef_min}, {self.kl_coef_max}]"
            " with kl_target",
            self.kl_coef,
        )
        _check(0 <= self.gamma <= 1, "ppo.gamma", "in [0, 1]", self.gamma)
        _check(0 <= self.gae_lambda <= 1, "ppo.gae_lambda", "in [0, 1]", self.gae_lambda)
        _check(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "ppo.max_grad_norm",
            "> 0 or null",
            self.max_grad_norm,
        )
        critic_clip = self.critic_max_grad_norm
        _check(critic_clip is None or critic_clip > 0, "ppo.critic_max_grad_norm", "> 0 or null", critic_clip)
        _check(
            critic_clip is None or self.uses_critic,
            "ppo.critic_max_grad_norm",
            f"null with advantage_estimator {self.advantage_estimator!r}, which trains no critic",
            critic_clip,
        )

    @property
    def clip_limits(self) -> tuple[float | None, ...]:
        """The gradient clip of each clipped set: one over the policy and the critic, or the
        policy's and the critic's (lightning_ppo.ppo.optim.clip_per_role)."""
        if self.critic_max_grad_norm is None:
            return (self.max_grad_norm,)
        return (self.max_grad_norm, self.critic_max_grad_norm)

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """``(low, high)`` of the policy ratio's clip: ``clip_range`` where a side is not set."""
        low, high = self.clip_range_low, self.clip_range_high
        return (self.clip_range if low is None else low, self.clip_range if high is None else high)

    def check_batch_size(self, batch_size: int) -> None:
        """Fail early when a rollout batch cannot be split into equal minibatches and micro-batches."""
        parts = self.num_minibatches * self.gradient_accumulation_steps
        sequences = batch_size * self.num_generations
        if sequences % parts:
            raise UsageError(
                f"the rollout batch (data.batch_size {batch_size} x ppo.num_generations "
                f"{self.num_generations} = {sequences} sequences) must divide into ppo.num_minibatches x "
                f"ppo.gradient_accumulation_steps = {self.num_minibatches} x "
                f"{self.gradient_accumulation_steps} = {parts} equal parts"
            )


_ENV_ERROR_POLICIES = ("error", "drop")


@dataclass
class EpisodeConfig:
    """Multi-turn episodes, used with ``model.environment`` (``lightning_ppo.rollout.episodes``).

    Args:
        max_turns: Policy turns per episode at most (>= 1); the environment can end one earlier.
        max_tokens: Token budget of an episode after its prompt, the policy's turns and the
            observations together (>= 1). An episode that reaches it is cut there, ends, and is
            counted (``episode/truncated``). The model's positions must hold the longest prompt
            plus this budget; that is checked before any model loads.
        on_error: ``error``: an environment that raises stops training with one line naming its
            class, the turn and the prompt (checkpoints already written stay as they were);
            ``drop``: that episode is left out of the update and counted (``episode/env_errors``).
        tool_format: How the policy calls ``model.tools``: ``hermes`` (``<tool_call>`` JSON, results as
            chat-template ``tool`` messages), ``text`` (``call NAME: ARGUMENT``), or ``auto``:
            ``hermes`` when the tokenizer has a chat template, else ``text``
            (``lightning_ppo.rollout.tools``).
        max_concurrency: How many of a batch's environment calls run at once, plain (``def``) ones
            each on a thread of its own, ``async def`` ones on the run's event loop (>= 1; 1: one by
            one). It also bounds the threads of timed-out plain calls still running.
        step_timeout: Seconds an environment's ``reset`` or ``step`` may take (``None``: no limit).
            One that takes longer is handled as one that raises (``on_error``), counted in
            ``episode/timeouts``; its thread cannot be stopped (``docs/agents.md``).
        tool_timeout: Seconds a tool call may take (``None``: no limit); one that takes longer
            answers the policy that it timed out, as a tool that raises does.
        keep_cache: Under ``generation.engine: hf``, keep each episode's KV cache from one turn to
            the next, so a turn reads only the observation's tokens, not the whole episode again
            (``lightning_ppo.rollout.kept_cache``; HF's dynamic cache). ``vllm`` reuses the
            episode's prefix on its own. Refused for models with sliding-window or chunked attention.
    """

    max_turns: int = 4
    max_tokens: int = 256
    on_error: str = "error"
    tool_format: str = "auto"
    max_concurrency: int = 64
    step_timeout: float | None = 300.0
    tool_timeout: float | None = 60.0
    keep_cache: bool = False

    def __post_init__(self) -> None:
        _check(self.max_turns >= 1, "episode.max_turns", ">= 1", self.max_turns)
        _check(self.max_tokens >= 1, "episode.max_tokens", ">= 1", self.max_tokens)
        _check(self.max_concurrency >= 1, "episode.max_concurrency", ">= 1", self.max_concurrency)
        for name in ("step_timeout", "tool_timeout"):
            value = getattr(self, name)
            _check(value is None or value > 0, f"episode.{name}", "> 0 or null", value)
        formats = ("auto", "hermes", "text")
        _check(self.tool_format in formats, "episode.tool_format", f"one of {formats}", self.tool_format)
        _check(
            self.on_error in _ENV_ERROR_POLICIES,
            "episode.on_error",
            f"one of {_ENV_ERROR_POLICIES}",
            self.on_error,
        )
