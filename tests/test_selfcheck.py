"""``lightning-ppo selfcheck``: the exact optimum, and training that lands on it or, with a known bug
injected (tests/selfcheck_bugs.py), does not.

``make test`` runs the math, one correct setup (PASS) and one bug (FAIL), each a real run of the
selfcheck task through the CLI in-process. The rest of the matrix (the other bugs, the estimators,
LoRA, ``max_staleness``, DDP and FSDP2 on 2 CPU ranks) is marked ``selfcheck`` and runs under
``make test-selfcheck``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from lightning_ppo.cli import main
from lightning_ppo.config import GenerationConfig, PPOConfig
from lightning_ppo.selfcheck import selfcheck
from lightning_ppo.selfcheck.exact import kl_to_optimum, rated_optimum, tilted_optimum
from lightning_ppo.selfcheck.induction import TwoTurns
from lightning_ppo.selfcheck.objective import other_objectives
from lightning_ppo.selfcheck.responses import ResponseSpace, float64_copy
from lightning_ppo.selfcheck.sampling import SamplingCheck, ratio_terms
from lightning_ppo.selfcheck.task import SelfcheckTask
from lightning_ppo.selfcheck.verdict import Plateau, judge
from lightning_ppo.watch.plot import read_metrics
from tests.helpers import cli_process, cli_usage_error
from tests.selfcheck_bugs import StaleWeights

BUG = "tests.selfcheck_bugs."
ESTIMATOR = "--model.init_args.ppo.advantage_estimator"
GROUPS = ("--model.init_args.ppo.num_generations", "4")
K3 = ("--model.init_args.ppo.kl_estimator", "k3")


def test_the_tilted_optimum_of_two_responses_by_hand():
    # pi_ref = (1/2, 1/2), r = (0, 1), beta = 1: pi* = (1, e) / (1 + e)
    ref = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log()
    rewards = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    optimum = tilted_optimum(ref, rewards, beta=1.0)
    p = math.e / (1 + math.e)
    assert optimum.reward == pytest.approx(p, abs=1e-12)
    kl = (1 - p) * math.log((1 - p) / 0.5) + p * math.log(p / 0.5)
    assert optimum.kl == pytest.approx(kl, abs=1e-12)
    assert optimum.reward_std == pytest.approx(math.sqrt(p * (1 - p)), abs=1e-12)
    assert optimum.objective == pytest.approx(math.log((1 + math.e) / 2), abs=1e-12)  # beta log Z
    assert (optimum.reference_reward, optimum.greedy_reward) == (0.5, 1.0)


def test_any_policy_falls_short_of_the_optimum_by_beta_times_its_kl_to_it():
    generator = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 40, generator=generator, dtype=torch.float64).log_softmax(1)
    rewards = torch.rand(3, 40, generator=generator, dtype=torch.float64)
    policy = torch.randn(3, 40, generator=generator, dtype=torch.float64).log_softmax(1)
    beta = 0.3
    optimum = tilted_optimum(ref, rewards, beta)
    objective = ((policy.exp() * rewards).sum(1) - beta * (policy.exp() * (policy - ref)).sum(1)).mean()
    shortfall = beta * kl_to_optimum(policy, ref, rewards, beta).mean()
    assert float(objective) == pytest.approx(optimum.objective - float(shortfall), abs=1e-12)


def test_two_raters_the_policy_cannot_tell_apart_tilt_it_by_their_mean_reward():
    # pi_ref = (1/2, 1/2); rater A pays (0, 1), rater B (0, 3); beta = 1: pi* = (1, e^2) / (1 + e^2)
    ref = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log()
    by_rater = torch.tensor([[[0.0, 1.0]], [[0.0, 3.0]]], dtype=torch.float64)
    optimum = rated_optimum(ref, by_rater, beta=1.0)
    p = math.e**2 / (1 + math.e**2)
    assert optimum.reward == pytest.approx(2 * p, abs=1e-12)
    assert optimum.objective == pytest.approx(math.log((1 + math.e**2) / 2), abs=1e-12)
    # the noise of a batch mean holding as many rows of each rater: each rater's spread, pooled
    assert optimum.reward_std == pytest.approx(math.sqrt((1 + 9) / 2 * p * (1 - p)), abs=1e-12)
    # r - beta log pi*/pi_ref is beta log Z plus the rater's disagreement with the mean, (0, -1) or (0, +1)
    assert optimum.objective_std == pytest.approx(math.sqrt(p * (1 - p)), abs=1e-12)


def test_settings_that_optimise_another_objective_are_named():
    assert other_objectives(PPOConfig(), GenerationConfig()) == ()
    grpo = yaml.safe_load(open("configs/grpo.yaml"))["model"]["init_args"]["ppo"]
    named = other_objectives(PPOConfig(**grpo), GenerationConfig())
    assert [o.setting for o in named] == ["ppo.kl_estimator k3, ppo.kl_placement loss"]
    several = other_objectives(PPOConfig(kl_estimator="k3", score_norm=True), GenerationConfig(top_k=2))
    assert [o.setting for o in several] == [
        "ppo.kl_estimator k3 (in the reward)",
        "ppo.score_norm",
        "generation.top_k 2, top_p 1",
    ]


def test_two_turns_any_policy_falls_short_of_the_induction_by_beta_times_its_kl_to_it():
    # random references, rewards and transitions: the soft Bellman optimum's identity, by brute force
    generator = torch.Generator().manual_seed(0)

    def logits(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).log_softmax(-1)

    episodes = TwoTurns(
        ref1=logits(2, 5),
        r1=torch.rand(2, 5, generator=generator, dtype=torch.float64),
        transition=logits(2, 5, 3).exp(),
        ref2=logits(2, 5, 3, 5),
        r2=torch.rand(2, 5, 3, 5, generator=generator, dtype=torch.float64),
    )
    beta = 0.4
    policy1, policy2 = logits(2, 5), logits(2, 5, 3, 5)
    prob, reward, log_ratio = episodes.episodes(policy1, policy2)
    objective = float((prob * (reward - beta * log_ratio)).flatten(1).sum(1).mean())
    optimum = episodes.optimum(beta)
    assert objective == pytest.approx(
        optimum.objective - beta * episodes.distance(policy1, policy2, beta), abs=1e-12
    )
    assert episodes.distance(*episodes.soft_policy(beta)[:2], beta) == pytest.approx(0.0, abs=1e-12)
    # the maximum is the optimum's own reward less beta times its KL, in the run's units
    assert optimum.objective == pytest.approx(optimum.reward - beta * optimum.kl, abs=1e-12)


def test_every_response_is_listed_once_and_their_probabilities_sum_to_one(tmp_path):
    task = SelfcheckTask()
    model, tokenizer = task.build()
    space = ResponseSpace((3, 4, 5), tokenizer.eos_token_id, max_new_tokens=3, temperature=0.7)
    responses = space.responses()
    assert len(responses) == 1 + 3 + 9 + 27 == len({r.token_ids for r in responses})
    logprobs = space.logprobs(float64_copy(model), [3])
    assert float(logprobs.exp().sum()) == pytest.approx(1.0, abs=1e-12)
    # each one is the sum of its tokens' log-probs, read here by hand for one ended response
    with torch.no_grad():
        logits = model.double()(torch.tensor([[3, 4, 5]])).logits[0] / 0.7
    allowed = torch.tensor([1, 3, 4, 5])
    step = logits[:, allowed].log_softmax(-1)  # columns: eos, x, y, z
    by_hand = float(step[0, 2] + step[1, 3] + step[2, 0])  # "y", "z", then the stop token
    assert float(logprobs[responses.index(next(r for r in responses if r.token_ids == (4, 5, 1)))]) == (
        pytest.approx(by_hand, abs=1e-12)
    )


def test_the_bands_are_sampling_noise_plus_what_the_allowance_moves():
    optimum = tilted_optimum(torch.tensor([[0.5, 0.5]]).log(), torch.tensor([[0.0, 1.0]]), beta=1.0)
    at_optimum = Plateau(10_000, (optimum.reward,) * 4, (optimum.kl,) * 4)
    reward, kl, objective = judge(optimum, at_optimum, epsilon=0.02, z=4.0)
    assert (
        reward.high == -reward.low == pytest.approx(4 * optimum.reward_std / 100 + optimum.reward_std * 0.2)
    )
    assert kl.high == pytest.approx(4 * optimum.kl_std / 100 + 0.02 + optimum.reward_std * 0.2)
    assert (objective.low, objective.high) == (
        pytest.approx(-0.02 - 4 * 0.2 / 100),
        pytest.approx(4 * 0.2 / 100),
    )
    assert reward.passed and kl.passed and objective.passed
    # the objective is at most its maximum: a plateau that claims more measured its KL wrong
    claims_more = Plateau(10_000, (optimum.reward + 0.01,) * 4, (optimum.kl,) * 4)
    assert not judge(optimum, claims_more, epsilon=0.02, z=4.0)[2].passed


def test_the_likelihood_ratio_of_the_sampled_responses_by_hand():
    # one prompt, claimed p = (1/2, 1/2), one update older q = (1/4, 3/4); rows: response 0, 0, 1
    claimed = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log()
    other = torch.tensor([[0.25, 0.75]], dtype=torch.float64).log()
    terms = ratio_terms(claimed, other, torch.tensor([0, 0, 0]), torch.tensor([0, 0, 1]))
    ratios = (math.log(2), math.log(2 / 3))  # log p - log q of each response
    kl = (ratios[0] + ratios[1]) / 2
    variance = ((ratios[0] - kl) ** 2 + (ratios[1] - kl) ** 2) / 2
    assert terms.tolist() == pytest.approx([2 * ratios[0] + ratios[1], 3 * kl, 3 * variance, 3, 0], abs=1e-12)
    check = SamplingCheck.of(terms[None])
    assert check.z == pytest.approx((2 * ratios[0] + ratios[1] - 3 * kl) / math.sqrt(3 * variance), abs=1e-12)
    # a response the claimed policy cannot give (an unlisted one, -1) fails it whatever z says
    unlisted = ratio_terms(claimed, other, torch.tensor([0, 0]), torch.tensor([0, -1]))
    assert unlisted[3:].tolist() == [2, 1] and not SamplingCheck.of(unlisted[None]).passed


def _moving_policies(generator: torch.Generator, iterations: int) -> torch.Tensor:
    """(iterations + 1, 2, 40) log-probs of a policy over two prompts' 40 responses, each version a
    small random step from the one before (as an update moves it)."""
    logits = torch.randn(2, 40, generator=generator, dtype=torch.float64)
    steps = 0.4 * torch.randn(iterations, 2, 40, generator=generator, dtype=torch.float64)
    return torch.cat([logits[None], logits + steps.cumsum(0)]).log_softmax(-1)


def _z(policies: torch.Tensor, lag: int, generator: torch.Generator, rows: int = 64) -> float:
    """The run's z when version t claims each batch and version t - lag sampled it (lag 0: as claimed)."""
    prompts = torch.arange(rows) % 2
    terms = []
    for t in range(1, len(policies)):
        sampler = policies[t - lag].exp()[prompts]
        responses = torch.multinomial(sampler, 1, generator=generator)[:, 0]
        terms.append(ratio_terms(policies[t], policies[t - 1], prompts, responses))
    return SamplingCheck.of(torch.stack(terms)).z


def test_the_sampling_z_is_standard_normal_as_claimed_and_far_below_when_one_update_older():
    generator = torch.Generator().manual_seed(0)
    claimed, older = [], []
    for _ in range(300):
        policies = _moving_policies(generator, iterations=20)
        claimed.append(_z(policies, 0, generator))
        older.append(_z(policies, 1, generator))
    claimed = torch.tensor(claimed)
    # as claimed: mean 0, std 1 (within 4 standard errors of 300 draws), never below the threshold
    assert abs(float(claimed.mean())) < 4 / math.sqrt(300)
    assert abs(float(claimed.std()) - 1) < 4 / math.sqrt(2 * 300)
    assert float(claimed.min()) > -4
    # one update older: z ~ -sqrt(2 N sum_t KL_t), here far below -4 in every run
    assert max(older) < -8


@pytest.mark.selfcheck
def test_a_correct_setup_lands_on_the_exact_optimum(tmp_path):
    result = selfcheck(tmp_path / "run", draw=False)
    assert result.passed, "\n".join(result.lines())
    assert abs(result.reward.gap) <= result.reward.band and abs(result.kl.gap) <= result.kl.band
    # without sampling noise: the trained policy itself ends within a few hundredths of a nat of pi*
    assert result.policy_distance < 0.05
    # its samples are the policy's it claims: z is a standard normal's draw (measured +1.13)
    assert result.sampling.rows == 119 * 64 and abs(result.sampling.z) < 3


@pytest.mark.selfcheck
def test_a_kl_term_with_the_wrong_sign_fails_through_the_command(tmp_path):
    args = [
        "selfcheck",
        "--out",
        str(tmp_path / "run"),
        "--no-plot",
        "--model.class_path",
        BUG + "WrongSignKL",
    ]
    assert main(args) == 1


def test_options_the_selfcheck_sets_itself_are_refused_in_one_line(capsys, tmp_path):
    args = ["selfcheck", "--out", str(tmp_path), "--model.init_args.ppo.kl_coef", "0.1"]
    error = cli_usage_error(capsys, args)
    assert error == "selfcheck: --model.init_args.ppo.kl_coef cannot be set: use --beta"
    error = cli_usage_error(capsys, ["selfcheck", "--out", str(tmp_path), "--turns", "2", "--raters", "2"])
    assert error == "selfcheck: --raters 2 is a one-turn task: drop --turns 2 or --raters 2"


# ----------------------------------------------------------------- the matrix: make test-selfcheck


@pytest.mark.selfcheck
@pytest.mark.parametrize("bug", ["ReferenceIsPolicy", "LogprobsShiftedByOne"])
def test_an_injected_bug_fails(tmp_path, bug):
    result = selfcheck(tmp_path / "run", "--model.class_path", BUG + bug, draw=False)
    assert not result.passed
    assert not result.reward.passed  # the reward alone already tells


@pytest.mark.selfcheck
@pytest.mark.parametrize("bug", [None, "WrongSignKL", "ReferenceIsPolicy"])
def test_two_turns_with_an_environment_between_pass_and_their_bugs_fail(tmp_path, bug):
    args = ["selfcheck", "--turns", "2", "--out", str(tmp_path / "run"), "--no-plot"]
    # a bug is out of its band long before the correct run settles: a third of the iterations
    injected = ["--model.class_path", BUG + bug, "--iterations", "66"] if bug else []
    assert main(args + injected) == (1 if bug else 0)


@pytest.mark.selfcheck
@pytest.mark.parametrize(
    "options, settings",
    [
        pytest.param((ESTIMATOR, "rloo", *GROUPS), {"batch_size": 16}, id="rloo"),
        pytest.param((ESTIMATOR, "grpo", *GROUPS), {"batch_size": 16}, id="grpo"),
        pytest.param(("--model.init_args.value_model", "shared"), {}, id="shared critic"),
        pytest.param(("--model.init_args.lora", json.dumps({"r": 8, "alpha": 16})), {"lr": 1e-2}, id="lora"),
        pytest.param(("--model.init_args.ppo.max_staleness", "1"), {}, id="max_staleness 1"),
        pytest.param(("--model.init_args.generation.temperature", "0.7"), {}, id="temperature 0.7"),
    ],
)
def test_a_correct_setup_passes(tmp_path, options, settings):
    result = selfcheck(tmp_path / "run", *options, draw=False, **settings)
    assert result.passed, "\n".join(result.lines())
    assert abs(result.sampling.z) < 3  # unremarkable: the samples are the claimed policy's


@pytest.mark.selfcheck
@pytest.mark.parametrize(
    "options, named",
    [
        pytest.param(K3, "ppo.kl_estimator k3 (in the reward)", id="k3 in the reward"),
        pytest.param(
            ("--model.init_args.generation.top_k", "2"), "generation.top_k 2, top_p 1", id="top_k 2"
        ),
        pytest.param(
            (ESTIMATOR, "grpo", *GROUPS, "--model.init_args.ppo.kl_placement", "loss", *K3),
            "ppo.kl_estimator k3, ppo.kl_placement loss",
            id="grpo with k3 in the loss (configs/grpo.yaml)",
        ),
    ],
)
def test_a_setting_that_optimises_another_objective_fails(tmp_path, options, named):
    settings = {"batch_size": 16} if "grpo" in options else {}
    result = selfcheck(tmp_path / "run", *options, draw=False, **settings)
    assert not result.passed, "\n".join(result.lines())
    assert [o.setting for o in result.other_objectives] == [named]  # the FAIL says which setting


FSDP2 = {
    "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
    "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
}


@pytest.mark.selfcheck
@pytest.mark.ranks
@pytest.mark.parametrize("strategy", ["ddp", json.dumps(FSDP2)], ids=["ddp", "fsdp2"])
def test_two_cpu_ranks_pass_through_lightnings_launcher(tmp_path, strategy):
    # each rank half the batch: an iteration has the one-process run's 64 responses, every rank's counted
    args = ["selfcheck", "--out", str(tmp_path / "run"), "--batch-size", "32", "--no-plot"]
    args += ["--trainer.devices", "2", "--trainer.strategy", strategy]
    done = cli_process(args, timeout=600, OMP_NUM_THREADS="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, series = read_metrics(tmp_path / "run" / "csv" / "version_0" / "metrics.csv")
    assert series["episode"][1][-1] == SelfcheckTask().iterations * 64


GRPO_BATCH = (ESTIMATOR, "grpo", *GROUPS, "--model.init_args.ppo.scale_rewards", "batch", "--batch-size", "8")


@pytest.mark.selfcheck
@pytest.mark.ranks
@pytest.mark.parametrize(
    "options, bug",
    [
        pytest.param(GRPO_BATCH, None, id="grpo, scale_rewards batch"),
        pytest.param(GRPO_BATCH, "WhitenedPerRank", id="grpo, scale_rewards batch, per rank"),
        pytest.param(("--batch-size", "32"), "WhitenedPerRank", id="gae, whitened per rank"),
    ],
)
def test_two_raters_on_two_ranks_fail_advantages_whitened_per_rank(tmp_path, options, bug):
    # each rank gets one rater's rows; the noisy rater's spread, whitened on its own rank, weighs its
    # rows less than the other's and the policy leans to the other rater's character
    args = ["selfcheck", "--raters", "2", "--out", str(tmp_path / "run"), "--no-plot", *options]
    args += ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
    args += ["--model.class_path", BUG + bug] if bug else []
    done = cli_process(args, timeout=600, OMP_NUM_THREADS="1")
    assert done.returncode == (1 if bug else 0), done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "selfcheck.json").read_text())
    if bug:  # out of the objective's band by far: the policy ends >= 0.5 nats from pi* (measured 0.9-1.6)
        assert result["objective"]["gap"] < 2 * result["objective"]["low"]


SAMPLED_WITH: list[tuple[str, float]] = []  # (when, the policy's weights summed) of StaleWeightsProbe


class StaleWeightsProbe(StaleWeights):
    """The stale-weights bug, noting which weights each rollout samples with and each update starts from."""

    def _sample(self, batch):
        SAMPLED_WITH.append(("sample", float(sum(p.double().sum() for p in self.policy.parameters()))))
        return super()._sample(batch)

    def training_step(self, batch, batch_idx):
        SAMPLED_WITH.append(("train", float(sum(p.double().sum() for p in self.policy.parameters()))))
        return super().training_step(batch, batch_idx)


@pytest.mark.selfcheck
def test_the_stale_weights_bug_samples_with_the_weights_before_the_last_update(tmp_path):
    # the plateau cannot see it (it cannot move the optimum, docs/selfcheck.md), the sampling check
    # can (test_stale_weights_fail_the_sampling_check_the_plateau_cannot_see); the injection is real
    SAMPLED_WITH.clear()
    selfcheck(tmp_path / "run", "--model.class_path", "tests.test_selfcheck.StaleWeightsProbe", iterations=8)
    trained = [w for when, w in SAMPLED_WITH if when == "train"]
    sampled = [w for when, w in SAMPLED_WITH if when == "sample"]
    assert sampled[0] == trained[0]  # the first has no older weights
    assert sampled[1:] == trained[:-1] and trained[1:] != trained[:-1]


@pytest.mark.selfcheck
def test_stale_weights_fail_the_sampling_check_the_plateau_cannot_see(tmp_path):
    # the rollout samples with the weights one update older than max_staleness 0 claims: the optimum
    # does not move (docs/selfcheck.md), the sampled responses' likelihoods tell
    result = selfcheck(tmp_path / "run", "--model.class_path", BUG + "StaleWeights", draw=False)
    assert not result.passed, "\n".join(result.lines())
    assert result.objective.passed
    assert not result.sampling.passed and result.sampling.z < -2 * result.sampling.z_crit
