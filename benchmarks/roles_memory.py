"""Memory of the four PPO roles in three layouts, for a GPT-2-small-sized model (random init).

    .venv/bin/python -m benchmarks.roles_memory            # 12 x 768, vocab 50257 (GPT-2 small)
    .venv/bin/python -m benchmarks.roles_memory --small    # 2 x 64, a few seconds (smoke test)

Each layout runs in its own process (so peak RSS is its own): build the module (policy,
reference, critic, reward model) and run one PPO iteration through the real Trainer, so the
optimizer state and gradients are counted too. Layouts:

- separate: policy + reference copy + critic with its own backbone + reward model (TRL's PPO);
- shared:   policy with a value head + reference copy + reward model;
- lora:     one frozen base serving policy (LoRA adapters), reference (adapter disabled) and a
            value head, + reward model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import common

LAYOUTS = {
    "separate": {"value_model": "separate"},
    "shared": {"value_model": "shared"},
    "lora": {"value_model": "shared", "lora": {"r": 16, "alpha": 32}},
}


def write_checkpoints(root: Path, small: bool) -> tuple[Path, Path]:
    """A random GPT-2 policy and a one-output GPT-2 reward model of the same size, on disk."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    from lightning_ppo.tasks.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer("0123456789=")
    size = dict(n_layer=2, n_embd=64, n_head=4) if small else dict(n_layer=12, n_embd=768, n_head=12)
    special = dict(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    config = dict(vocab_size=50257, n_positions=1024, **special, **size)
    policy, reward = root / "policy", root / "reward"
    GPT2LMHeadModel(GPT2Config(**config)).save_pretrained(policy)
    GPT2ForSequenceClassification(GPT2Config(num_labels=1, **config)).save_pretrained(reward)
    for path in (policy, reward):
        tokenizer.save_pretrained(path)
    return policy, reward


def measure(layout: str, policy: str, reward: str) -> dict[str, float]:
    """Build one layout, run one PPO iteration, and report its memory (runs in a child process)."""
    import lightning.pytorch as pl
    import torch

    from lightning_ppo import GenerationConfig, PPOConfig, PPOLightningModule, PromptDataModule
    from lightning_ppo.models.roles import LoraSettings

    options = dict(LAYOUTS[layout])
    lora = options.pop("lora", None)
    module = PPOLightningModule(
        policy=policy,
        reward_model=reward,
        value=policy,
        lora=LoraSettings(**lora) if lora else None,
        ppo=PPOConfig(ppo_epochs=1, num_minibatches=1),
        generation=GenerationConfig(max_new_tokens=8),
        **options,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=PromptDataModule(prompts=["12345="] * 4, batch_size=4))
    unique = {id(p): p for p in module.parameters()}.values()
    trainable = sum(p.numel() * p.element_size() for p in unique if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in unique if not p.requires_grad)
    optimizer = trainer.optimizers[0]
    state = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    return {
        "params_mb": (trainable + frozen) / 2**20,
        "trainable_mb": trainable / 2**20,
        "optimizer_mb": state / 2**20,
        "peak_rss_mb": common.peak_rss_mib(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 2 x 64 model instead of GPT-2 small")
    parser.add_argument("--child", nargs=3, metavar=("LAYOUT", "POLICY", "REWARD"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        print(json.dumps(measure(*ns.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        policy, reward = write_checkpoints(Path(tmp), ns.small)
        rows = {}
        for layout in LAYOUTS:
            cmd = [
                sys.executable,
                "-m",
                "benchmarks.roles_memory",
                "--child",
                layout,
                str(policy),
                str(reward),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows[layout] = json.loads(out.strip().splitlines()[-1])
    base = rows["separate"]
    print(
        "| layout | parameters (MB) | trained (MB) | optimizer state (MB) | peak RSS (MB) | RSS vs separate |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for layout, row in rows.items():
        print(
            f"| {layout} | {row['params_mb']:.0f} | {row['trainable_mb']:.1f} | {row['optimizer_mb']:.1f} "
            f"| {row['peak_rss_mb']:.0f} | {row['peak_rss_mb'] / base['peak_rss_mb']:.2f}x |"
        )


if __name__ == "__main__":
    main()
