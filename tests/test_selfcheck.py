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

from lightning_ppo.cli import main
from lightning_ppo.selfcheck import selfcheck
from lightning_ppo.selfcheck.exact import kl_to_optimum, tilted_optimum
from lightning_ppo.selfcheck.induction import TwoTurns
from lightning_ppo.selfcheck.responses import ResponseSpace, float64_copy
from lightning_ppo.selfcheck.task import SelfcheckTask
from lightning_ppo.selfcheck.verdict import Plateau, judge
from lightning_ppo.watch.plot import read_metrics
from tests.helpers import cli_process, cli_usage_error

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


@pytest.mark.selfcheck
def test_a_correct_setup_lands_on_the_exact_optimum(tmp_path):
    result = selfcheck(tmp_path / "run", draw=False)
    assert result.passed, "\n".join(result.lines())
    assert abs(result.reward.gap) <= result.reward.band and abs(result.kl.gap) <= result.kl.band
    # without sampling noise: the trained policy itself ends within a few hundredths of a nat of pi*
    assert result.policy_distance < 0.05


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


@pytest.mark.selfcheck
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(K3, id="k3 in the reward"),
        pytest.param(("--model.init_args.generation.top_k", "2"), id="top_k 2"),
        pytest.param(
            (ESTIMATOR, "grpo", *GROUPS, "--model.init_args.ppo.kl_placement", "loss", *K3),
            id="grpo with k3 in the loss (configs/grpo.yaml)",
        ),
    ],
)
def test_a_setting_that_optimises_another_objective_fails(tmp_path, options):
    settings = {"batch_size": 16} if "grpo" in options else {}
    result = selfcheck(tmp_path / "run", *options, draw=False, **settings)
    assert not result.passed, "\n".join(result.lines())


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
