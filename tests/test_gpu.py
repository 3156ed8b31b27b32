"""What only a GPU shows: CUDA autocast, CUDA attention kernels, the roles on the device.

Skipped where no CUDA device is present (every CI run); `make gpu-check` runs these on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from tests.test_precision import PRECISIONS, check_trained, checkpoints, fit  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (`make gpu-check` runs these where one is at hand)",
)


class WhereTheWeightsTrain(Callback):
    """The devices of the module's weights while it trains (the Trainer moves it to the CPU after)."""

    devices: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.devices = {p.device.type for p in pl_module.parameters()}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "mistral"])
def test_every_family_generates_and_trains_on_cuda_under_every_precision(checkpoints, arch, precision):  # noqa: F811
    where = WhereTheWeightsTrain()
    module, trainer, metrics = fit(checkpoints[arch], precision, accelerator="cuda", callbacks=[where])
    check_trained(module, trainer, metrics, precision)
    assert where.devices == {"cuda"}


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_lora_on_a_rope_policy_trains_on_cuda(checkpoints, precision, cache):  # noqa: F811
    module, trainer, metrics = fit(checkpoints["llama"], precision, cache, lora=True, accelerator="cuda")
    check_trained(module, trainer, metrics, precision)
