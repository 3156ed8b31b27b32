"""What runs inside a vLLM generation server: the worker extension the trainer drives.

``lightning-ppo serve`` starts ``vllm serve`` with ``--worker-extension-cls`` naming
:class:`WeightSyncExtension`; vLLM mixes it into each of the server's workers, and the trainer calls
its methods through the server's ``/collective_rpc`` route (``VLLM_SERVER_DEV_MODE=1``), whose
arguments are strings and whose answers are JSON.

vLLM 0.32 has no weight-transfer backend that moves bytes on CPU (its NCCL engine needs GPUs), so
the weights travel as one safetensors file the trainer writes and every worker loads in place with
vLLM's own reload. The same path works on GPUs wherever the trainer and the server share a disk.
What a worker holds afterwards is reported back as per-parameter checksums, so a load that moved
nothing, or moved the wrong tensors, is seen by the trainer (:mod:`.weight_sync`).

This module imports only torch and safetensors at the top: it is imported inside the server.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors import safe_open

# The calls' arguments and answers between a trainer and this extension, numbered: raised whenever
# they change (2: lppo_receive names its group's secret), so a trainer and a server of different
# lightning_ppo installs refuse each other before the first sync, in one line naming both numbers,
# instead of failing each call with a TypeError from the server.
PROTOCOL = 2


def checksums(model: torch.nn.Module) -> dict[str, list[float]]:
    """``name: [sum, sum of squares, numel]`` of every parameter, in float64, a bounded chunk at a
    time (:mod:`.checksum`: the server's GPU has no room for a float64 copy of a large tensor).

    Both sums are unchanged by the ways an engine rearranges a checkpoint's tensor (transposed,
    fused with its neighbours into one parameter, stacked with the other experts, padded with zero
    rows), so the trainer can compute the same numbers from its own tensors; see
    :func:`.weight_sync.mismatch`. A quantized layer's parameters (fp8, int8, packed int4: a
    parameter that is not float16/bfloat16/float32) are left out, with their scales: their sums are
    not the checkpoint's, and the trainer says it cannot check them (:func:`.weight_sync.unchecked`).
    """
    from lightning_ppo.rollout.engines.server.checksum import checksum

    params = list(model.named_parameters())
    quantized = {name.rpartition(".")[0] for name, param in params if param.dtype not in _FLOATS}
    sums = {}
    for name, param in params:
        if name.rpartition(".")[0] in quantized:
            continue
        weight = held_weight(model, name, param)
        sums[name] = [*checksum(weight), float(weight.numel())]
    return sums


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@torch.no_grad()
def held_weight(model: torch.nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    """The weight a layer computes with. vLLM's CPU backend packs a linear layer's weight into its
    GEMM kernel's layout and empties the parameter (``cpu_linear``); the kernel applied to the
    identity gives the weight back, exactly (each output is one weight times 1 plus zeros), and
    proves what the kernel itself multiplies by, not what a parameter says."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf != "weight" or param.numel() > 0 or not hasattr(module, "cpu_linear"):
        return param
    inputs = int(getattr(module, "input_size_per_partition", 0) or module.input_size)
    identity = torch.eye(inputs, dtype=_dtype(model), device=param.device)
    return module.cpu_linear(identity, param, None)


def _dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in (its first floating-point parameter's)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point() and p.numel() > 0)


class WeightSyncExtension:
    """Methods vLLM adds to every worker of a ``lightning-ppo serve`` server."""

    # The trainer's sync count of the weights loaded last ("": the startup checkpoint's): a server
    # restarted between a sync and a batch is seen before it samples, one restarted while the batch
    # was out after its answers, before any is trained on (server.VLLMServerEngine).
    lppo_weights_version = ""

    def lppo_describe(self) -> dict[str, Any]:
        """What the trainer checks before the first rollout: the model, its vocabulary and the
        settings that change what sampling returns; and how the model fuses checkpoint tensors."""
        model_config = self.model_runner.model_config  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf_config = model_config.hf_config
        return {
            "protocol": PROTOCOL,
            "model": str(model_config.model),
            "architectures": list(getattr(hf_config, "architectures", None) or []),
            "vocab_size": int(model_config.get_vocab_size()),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "logprobs_mode": str(model_config.logprobs_mode),
            "generation_config": str(model_config.generation_config),
            "packed_modules": {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()},
        }

    def lppo_load(
        self, path: str, with_checksums: str = "1", version: str = ""
    ) -> dict[str, list[float]] | None:
        """Load the safetensors file at ``path`` into the model in place, as weights ``version``; the
        checksums after (``with_checksums`` ``"1"``: they cost about one forward over as many tokens
        as the widest layer has inputs, on CPU)."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        self.lppo_weights_version = ""  # a load that fails part way holds no version
        self.reload_weights(weights_iterator=_tensors(path))  # type: ignore[attr-defined]
        _repack_embedding_gemms(model)
        self.lppo_weights_version = version
        return checksums(model) if with_checksums == "1" else None

    def lppo_join(
        self, host: str, port: str, world: str, first: str, timeout: str, device: str, secret: str = ""
    ) -> int:
        """Join the trainer's weights group (:mod:`.weight_group`) as rank ``first`` + this worker's
        rank within the server; returns once the group is whole (every worker and the trainer).
        The group's ``secret`` names it: :meth:`lppo_group` answers it, so the trainer sees a worker
        that holds another group or none (a restarted server) and joins it again. The worker gives
        the others ``device`` where the trainer names one, else :func:`.weight_group.advertised_address`
        (its address towards rank 0 at ``host``, or ``LIGHTNING_PPO_SYNC_HOST``); a join that fails
        says which, and why that one."""
        from lightning_ppo.rollout.engines.server.weight_group import (
            advertised_address,
            open_group,
            still_served,
        )

        rank = int(first) + int(getattr(self, "rank", 0))
        try:
            address, why = (device, "given by the trainer") if device else advertised_address(host)
        except OSError as err:  # a name this machine cannot resolve, no route to rank 0
            raise RuntimeError(
                f"weights group rank {rank}: this server finds no route to rank 0 at {host} "
                f"(generation.sync_address): {err}"
            ) from None
        try:
            # The trainer's join may have ended (Ctrl-C, its timeout), looked at before a group held
            # is let go: a stopped join's call that arrives late keeps the group a later join made
            # (or the next sync's receive finds none held).
            still_served(host, int(port), float(timeout))
            self._lppo_let_go()  # a group held from before (a stopped sync, another run's)
            group = open_group(host, int(port), rank, int(world), float(timeout), address, secret)
        except Exception as err:
            raise RuntimeError(
                f"weights group rank {rank}, at {address} ({why}), could not join rank 0 at {host}:{port}: "
                f"{type(err).__name__}: {err}"
            ) from None
        self.lppo_weights_group, self.lppo_group_secret = group, secret
        return rank

    def lppo_group(self) -> str:
        """The secret of the weights group this worker holds ("" for none)."""
        return getattr(self, "lppo_group_secret", "")

    def lppo_receive(
        self, with_checksums: str = "1", version: str = "", secret: str = ""
    ) -> dict[str, list[float]] | None:
        """Load the weights the trainer broadcasts over its group, as they arrive, as ``version``;
        the checksums after, as :meth:`lppo_load`. A load that fails stops the sync for every member
        at once (the trainer raises this worker's error, its receiving thread ends) and lets go of
        the group: the trainer makes a new one for the next sync. ``secret`` names the group the
        call is for: a stopped sync's call that reaches the server after the next join (its thread
        late, a slow network) is refused, or it would take the next sync's weights for its own and
        leave that sync's call waiting for weights already taken."""
        from lightning_ppo.rollout.engines.server.weight_group import receive

        group = getattr(self, "lppo_weights_group", None)
        if not self.lppo_group() or group is None:
            raise RuntimeError("this server holds no weights group of a trainer (restarted since it joined?)")
        if secret and secret != self.lppo_group():
            raise RuntimeError(
                f"the receive of weights {version} is for a weights group this worker no longer holds "
                "(a stopped sync's call, arriving after the next join)"
            )
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        self.lppo_weights_version = ""
        weights = receive(group, version)
        try:
            self.reload_weights(weights_iterator=iter(weights))  # type: ignore[attr-defined]
            if not weights.whole:
                raise RuntimeError("the load returned before the last of the weights arrived")
        except BaseException as err:
            weights.stop(f"{type(err).__name__}: {err}")
            self._lppo_let_go(group)
            raise
        _repack_embedding_gemms(model)
        self.lppo_weights_version = version
        return checksums(model) if with_checksums == "1" else None

    def _lppo_let_go(self, group: Any = None) -> None:
        """Hold no weights group any more, or not ``group`` (a later join's is kept); its destructor
        runs on a thread of its own."""
        held = getattr(self, "lppo_weights_group", None)
        if group is None or group is held:
            group, self.lppo_weights_group, self.lppo_group_secret = held, None, ""
        if group is not None:
            group.let_go()

    def lppo_set_version(self, version: str) -> str:
        """Hold weights ``version``: set by the trainer around vLLM's own weight transfer
        (:mod:`.nccl_sync`), "" before it starts and the version once it finished."""
        self.lppo_weights_version = version
        return version

    def lppo_version(self) -> str:
        """The version of the weights loaded last ("" for the startup checkpoint's)."""
        return self.lppo_weights_version

    def lppo_checksums(self) -> dict[str, list[float]]:
        """The checksums of what the worker holds now."""
        return checksums(self.model_runner.get_model())  # type: ignore[attr-defined]


def _tensors(path: str) -> Any:
    """The file's tensors one at a time, so the worker never holds two copies of the model."""
    with safe_open(path, framework="pt", device="cpu") as file:
        for name in file.keys():  # noqa: SIM118 (safe_open has no __iter__)
            yield name, file.get_tensor(name)


def _repack_embedding_gemms(model: torch.nn.Module) -> None:
    """vLLM 0.32's in-place reload leaves the CPU backend's packed tied LM head stale; see
    :func:`lightning_ppo.rollout.engines.vllm.repack_embedding_gemms` (imported late: vLLM)."""
    from lightning_ppo.rollout.engines.vllm import repack_embedding_gemms

    repack_embedding_gemms(model)
