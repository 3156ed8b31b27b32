"""FSDP2 (Lightning's ModelParallelStrategy) on 2 CPU processes (gloo), through the real CLI.

The sharded run must train the same model as DDP: same seeds, same prompts per rank, same
samples, the same optimizer steps; only the order of float additions in the gradient reduction
(reduce-scatter of shards vs all-reduce of buckets) and in the gradient norm differs.

Tolerance, measured (2 iterations = 16 AdamW steps of lr 1e-3, which move the weights by ~1e-2):
every weight agrees with DDP's to 1.2e-7 (1 float32 ulp at magnitude 1), asserted at 5e-7;
except GPT-2's attention key bias. Its exact gradient is 0 (softmax ignores a shift shared by all
keys), so the float gradient is pure rounding noise, which Adam divides by its own RMS into steps
of up to ~lr: that slice only has to stay within steps x lr (measured: 6.7e-6; 6.2e-6 at most
since the runs read 400 prompts, not the configs' 40000, the rest still within 1.2e-7).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from lightning_ppo.export import export_policy, load_trained_policy
from tests.helpers import (
    forked_cli_process,
    free_port,
    quickstart_fit_args,
    ranks_process,
    spawn_forked,
    two_cpu_ranks,
)

pytestmark = pytest.mark.ranks  # several processes: run alone (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
FSDP2 = {
    "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
    "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1},
}
STEPS, LR = 16, 1e-3  # 2 iterations x ppo_epochs 4 x num_minibatches 2; quickstart's AdamW lr
ATOL = 5e-7
MAX_NEW_TOKENS = 24  # long enough that the two ranks' longest responses usually differ


def run_cli(
    policy: Path,
    out: Path,
    strategy: str | dict,
    *extra: str,
    config: str = "quickstart.yaml",
    together: bool = True,
) -> subprocess.CompletedProcess:
    """The two ranks started at once (the subject is FSDP2, not Lightning's launcher); ``together``
    false: rank 0 alone, forked as a user's ``python -m`` (Lightning's launcher in it starts rank 1
    as a new interpreter, if it gets that far)."""

    recorder = {"class_path": "tests.helpers.TrainedWeightsRecorder", "init_args": {"out_dir": str(out)}}
    recorded = ("--model.init_args.generation.max_new_tokens", str(MAX_NEW_TOKENS))
    accumulated = ("--model.init_args.ppo.gradient_accumulation_steps", "2")
    args = quickstart_fit_args(
        policy,
        out,
        [recorder],
        *two_cpu_ranks(strategy),
        *recorded,
        *accumulated,
        *extra,
        # 400 prompts, not the configs' 40000: the comparison is of two runs on the same data, whichever
        # (tokenizing 40000 took ~2.5-5 s per rank, 12 runs of 2 ranks in this file)
        config=ROOT / "configs" / config,
    )
    return ranks_process(args) if together else forked_cli_process(args)


def trained(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights_rank{rank}.pt", weights_only=True)


def assert_same_training(ddp: dict[str, torch.Tensor], fsdp2: dict[str, torch.Tensor]) -> None:
    assert fsdp2.keys() == ddp.keys()
    for key, weight in fsdp2.items():
        expected = ddp[key]
        if key.endswith("attn.c_attn.bias"):  # GPT-2's packed (query, key, value) bias
            n = weight.numel() // 3
            key_bias = slice(n, 2 * n)
            torch.testing.assert_close(weight[key_bias], expected[key_bias], rtol=0, atol=STEPS * LR)
            weight, expected = weight[torch.arange(3 * n) // n != 1], expected[torch.arange(3 * n) // n != 1]
        torch.testing.assert_close(weight, expected, rtol=0, atol=ATOL, msg=lambda m, key=key: f"{key}: {m}")


LAYOUTS = {
    "full-separate": ["--model.init_args.value_model", "separate"],
    "full-shared": ["--model.init_args.value_model", "shared"],
    # PEFT inside fully_shard'ed blocks; generate goes around the PeftModel's forward.
    "lora-shared": ["--model.init_args.value_model", "shared", "--model.init_args.lora", '{"r": 4}'],
    # no accumulation: micro-batches of similar lengths within a token budget, each rank's own plan
    # (different counts: a rank with fewer runs idle micro-batches of weight 0 up to the other's)
    "token-budget": [
        *("--model.init_args.ppo.gradient_accumulation_steps", "1"),
        *("--model.init_args.ppo.micro_batch_tokens", "48"),
    ],
    # critic-free, group advantages, KL in the loss
    "grpo": [
        *("--model.init_args.ppo.advantage_estimator", "grpo", "--model.init_args.ppo.num_generations", "2"),
        *("--model.init_args.ppo.kl_placement", "loss", "--model.init_args.ppo.kl_estimator", "k3"),
    ],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp2_trains_as_ddp_does_and_ranks_stop_generating_apart(tiny_digits, tmp_path, layout):
    out = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp2", FSDP2)):
        out[name] = tmp_path / name
        done = run_cli(tiny_digits, out[name], strategy, *LAYOUTS[layout])
        assert done.returncode == 0, done.stderr[-3000:]
        # the critic returns a new tensor: FSDP2 warned that its view "can ... produce wrong gradients"
        # (transformers' own logits_to_keep slice of the policy's output still is one; nothing
        # writes into it)
        assert "module (ValueModel) returned a view tensor" not in done.stderr
    ddp, fsdp2 = trained(out["ddp"], 0), trained(out["fsdp2"], 0)
    critic = {"full-separate": "roles.value_model.", "full-shared": "roles.value_head."}.get(layout)
    if critic is not None:  # the critic's gradients, too, match DDP's: its weights are compared
        assert any(key.startswith(critic) for key in fsdp2)
    for key, weight in trained(out["fsdp2"], 1).items():
        assert torch.equal(weight, fsdp2[key]), key  # one model: both ranks gathered the same weights
    assert_same_training(ddp, fsdp2)
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_digits).named_parameters())
    policy = {k.removeprefix("roles.policy."): v for k, v in ddp.items() if k.startswith("roles.policy.")}
    moved = max(
        (w - initial[k].detach().double() if k in initial else w).abs().max()
        for k, w in policy.items()
        if k in initial or "lora_B" in k
    )
    assert moved > 1000 * ATOL  # the tolerance is far below what training changed (LoRA B starts at 0)
    # Sampling matched DDP's, and the ranks' longest responses differed (the rank that finished first
    # stopped generating: the gathered policy communicates nothing per token).
    lengths = [json.loads((out["fsdp2"] / f"lengths_rank{r}.json").read_text()) for r in (0, 1)]
    assert lengths == [json.loads((out["ddp"] / f"lengths_rank{r}.json").read_text()) for r in (0, 1)]
    assert any(a != b and min(a, b) < MAX_NEW_TOKENS - 1 for a, b in zip(*lengths, strict=True))


def test_fsdp1_strategy_is_refused_with_a_pointer_to_model_parallel(tiny_digits, tmp_path):
    done = run_cli(tiny_digits, tmp_path, "fsdp", together=False)  # refused before rank 1 starts
    assert done.returncode != 0
    assert "FSDPStrategy (FSDP1) does not support manual optimization" in done.stderr
    assert "ModelParallelStrategy" in done.stderr


def test_fsdp2_resumes_exactly_and_exports_from_a_sharded_checkpoint(tiny_digits, tmp_path, monkeypatch):
    saver = {
        "class_path": "lightning_ppo.checkpoint.PPOCheckpoint",
        "init_args": {"every_n_iterations": 1, "save_top_k": -1},
    }
    saving = ("--trainer.enable_checkpointing", "true", "--trainer.callbacks+", json.dumps(saver))
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    done = run_cli(tiny_digits, whole, FSDP2, *saving, config="fsdp2.yaml")  # the shipped config
    assert done.returncode == 0, done.stderr[-3000:]
    first = whole / "checkpoints" / "iteration=1.ckpt"
    assert (first / "meta.pt").is_file()  # Lightning's distributed checkpoint: a folder of shards
    # the trained weights only (the frozen reference is reloaded from its path), resumed bitwise below
    saved = {
        key.removeprefix("state_dict.") for key in FileSystemReader(first).read_metadata().state_dict_metadata
    }
    assert trained(whole, 0).keys() <= saved
    assert not [key for key in saved if key.startswith("roles.ref_policy.")]
    done = run_cli(tiny_digits, resumed, FSDP2, *saving, "--ckpt_path", str(first), config="fsdp2.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        expected, got = trained(whole, rank), trained(resumed, rank)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in got)  # bitwise: weights, Adam, RNG, data
    # The sharded last checkpoint exports to an ordinary Hugging Face folder with the trained weights,
    # reading only the policy's and the critic's weights (not the optimizer state).
    read, read_data = [], FileSystemReader.read_data
    monkeypatch.setattr(
        FileSystemReader,
        "read_data",
        lambda self, plan, *a: read.extend(plan.items) or read_data(self, plan, *a),
    )
    exported = export_policy(whole / "checkpoints" / "last.ckpt", tmp_path / "exported")
    wanted = {key for key in saved if key.startswith(("roles.policy.", "roles.value_model."))}
    assert {item.storage_index.fqn.removeprefix("state_dict.") for item in read} == wanted
    model = AutoModelForCausalLM.from_pretrained(exported.out)
    expected = AutoModelForCausalLM.from_pretrained(tiny_digits)
    weights = trained(whole, 0)
    policy = {k.removeprefix("roles.policy."): v.float() for k, v in weights.items() if "roles.policy." in k}
    assert not expected.load_state_dict(policy, strict=False).unexpected_keys
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=0, atol=1e-5)
    # the same model, bit for bit, as built from Lightning's reader of every key (export's reader before)
    everything = load_trained_policy(_load_distributed_checkpoint(whole / "checkpoints" / "last.ckpt"))
    exported_weights = model.state_dict()
    assert all(torch.equal(exported_weights[k], w) for k, w in everything.state_dict().items())


def test_fsdp2_trains_multi_turn_episodes_as_ddp_does(tiny_digits, tmp_path):
    """configs/agents.yaml on 2 ranks: each turn's generate gathers the sharded policy with both ranks
    (ranks take the same number of turns), and the training matches DDP's."""
    budget = ("--model.init_args.episode.max_tokens", "60")
    out = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp2", FSDP2)):
        out[name] = tmp_path / name
        done = run_cli(tiny_digits, out[name], strategy, *budget, config="agents.yaml")
        assert done.returncode == 0, done.stderr[-3000:]
    assert_same_training(trained(out["ddp"], 0), trained(out["fsdp2"], 0))


def _sharded_generation_and_norm(rank: int, port: int, policy: str, out: str) -> None:
    import os

    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_ppo.distributed.sharding import gathered_for_generation, reshard, shard_model
    from lightning_ppo.ppo.optim import grad_norm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = AutoModelForCausalLM.from_pretrained(policy)
        mesh = init_device_mesh("cpu", (2,))
        shard_model(model, mesh, None)
        gathers, original = [], param_group.foreach_all_gather  # FSDP2's one call per unit gathered
        param_group.foreach_all_gather = lambda *a, **k: gathers.append(1) or original(*a, **k)
        reduces, all_reduce = [], dist.all_reduce  # Hugging Face's synced_gpus: one per new token
        dist.all_reduce = lambda *a, **k: reduces.append(1) or all_reduce(*a, **k)
        ids = torch.tensor([[5, 6, 7, 13]] * 2)
        kwargs = {"do_sample": True, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
        counts = []
        for gathered in (False, True):  # generation.gather_for_generation off, on
            gathers.clear()
            with gathered_for_generation(model, enabled=gathered):
                sixteen = {"max_new_tokens": 16, "min_new_tokens": 16}
                model.generate(input_ids=ids, synced_gpus=True, **sixteen, **kwargs)
            counts.append(len(gathers))
        gathers.clear()
        reduces.clear()
        with gathered_for_generation(model):  # as the module calls it: the ranks stop apart, unsynced
            new = 4 if rank == 0 else 16
            model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        counts += [len(gathers), len(reduces), "generate" in model.__dict__]
        dist.all_reduce = all_reduce
        # the gradient norm and clip of sharded gradients: torch's own on DTensors, to the bit
        reshard(model)  # the root stays whole after generating
        params = list(model.parameters())
        local = [torch.randn_like(p.to_local()) * (100 if rank else 1) for p in params]
        norms = {}
        for clip in (None, 1.0):
            for name in ("torch", "ours"):
                for p, g in zip(params, local, strict=True):
                    shape = {"shape": p.shape, "stride": p.stride()}
                    p.grad = DTensor.from_local(g.clone(), mesh, p.placements, **shape)
                if name == "ours":
                    norm = grad_norm(params, clip)
                elif clip is None:
                    norm = torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()
                else:
                    norm = torch.nn.utils.clip_grad_norm_(params, clip).full_tensor()
                norms[f"{name} {clip}"] = [norm.tolist(), *(p.grad.to_local().tolist() for p in params)]
        counts.append(norms["torch None"] == norms["ours None"] and norms["torch 1.0"] == norms["ours 1.0"])
        Path(out, f"gathers{rank}.json").write_text(json.dumps(counts))
    finally:
        dist.destroy_process_group()


def test_generation_gathers_each_block_once_and_the_norm_of_shards_is_torchs(tiny_digits, tmp_path):
    """16 new tokens through a 2-block GPT-2 sharded on 2 ranks: 33 all-gathers (each block per
    token, and the root once) with ``generation.gather_for_generation: false``, 2 with it on (each
    block once). Gathered, a decoding step communicates nothing, so the ranks generate unsynced
    (Hugging Face's ``synced_gpus`` all-reduced a flag at every token): one rank stops after 4 tokens,
    the other runs on to 16, with no all-reduce. The gradient norm (and clip) of the sharded
    gradients, computed on their shards (``ppo.optim.grad_norm``), is torch's on the DTensors bit for bit."""
    spawn_forked(_sharded_generation_and_norm, args=(free_port(), str(tiny_digits), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"gathers{rank}.json").read_text()) == [33, 2, 2, 0, False, True]
