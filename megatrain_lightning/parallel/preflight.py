"""Checks of a data-parallel launch before anything large is allocated, so that the ranks neither wait for each other
until the timeout nor mismatch in their collectives nor silently train apart: the rendezvous settings
(:func:`check_rendezvous`, at ``Trainer(...)``), and the same model, options, step settings, optimizer and LR
schedulers on every rank (:func:`check_same_config`, at ``setup``); docs/internals/data-parallel.md, "Faults and bad
input".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping

import torch
import torch.distributed as dist


class RendezvousError(ValueError):
    """The environment of a data-parallel launch contradicts the Trainer's ``devices`` / ``num_nodes``."""


class ConfigMismatchError(RuntimeError):
    """The ranks of a data-parallel run were started with different models or options."""


_LAUNCH_HINT = ("Launch one `python train.py` per node with MASTER_ADDR=<address of node 0> MASTER_PORT=<free port> "
                "NODE_RANK=<0..num_nodes-1>, or use torchrun (--nnodes, --nproc_per_node=devices, --node_rank) "
                "or SLURM (srun, --ntasks-per-node=devices).")


def check_rendezvous(env: Mapping[str, str], cluster_environment: Any, devices: int, num_nodes: int) -> None:
    """Check the launch's environment variables (``env``: ``os.environ``) against ``Trainer(devices=devices,
    num_nodes=num_nodes)`` (``devices``: processes per node) and Lightning's ``cluster_environment``.

    Raises:
        RendezvousError: ``WORLD_SIZE`` is set and is not ``devices * num_nodes``; ``NODE_RANK`` (or torchrun's
            ``GROUP_RANK``) is not an integer in ``[0, num_nodes)``; ``MASTER_PORT`` is not a port number; or a
            plain ``python train.py`` launch with ``num_nodes > 1`` lacks ``MASTER_ADDR`` or ``NODE_RANK``.
    """
    world = devices * num_nodes
    if "WORLD_SIZE" in env:
        try:
            got = int(env["WORLD_SIZE"])
        except ValueError:
            got = None
        if got != world:
            raise RendezvousError(
                f"megatrain: the environment says WORLD_SIZE={env['WORLD_SIZE']} but Trainer(devices={devices}, "
                f"num_nodes={num_nodes}) makes {world} processes. Make them agree (torchrun --nproc_per_node="
                f"{devices} --nnodes={num_nodes}; or the Trainer's devices/num_nodes, Hydra keys trainer.devices / "
                "trainer.num_nodes), or unset WORLD_SIZE for a plain `python train.py` launch.")
    for key in ("NODE_RANK", "GROUP_RANK"):
        if key in env:
            try:
                node = int(env[key])
            except ValueError:
                node = -1
            if not 0 <= node < num_nodes:
                raise RendezvousError(
                    f"megatrain: {key}={env[key]} but Trainer(num_nodes={num_nodes}) has nodes 0..{num_nodes - 1}. "
                    f"Set {key} to this node's index, below num_nodes (or raise num_nodes, Hydra key "
                    "trainer.num_nodes).")
            break
    if "MASTER_PORT" in env:
        try:
            port = int(env["MASTER_PORT"])
        except ValueError:
            port = 0
        if not 0 < port < 65536:
            raise RendezvousError(f"megatrain: MASTER_PORT={env['MASTER_PORT']} is not a port number (1..65535). "
                                  "Set it to a free TCP port of node 0, the same on every node.")
    if num_nodes > 1 and not cluster_environment.creates_processes_externally:
        missing = [k for k in ("MASTER_ADDR", "NODE_RANK") if k not in env and not (k == "NODE_RANK" and "GROUP_RANK" in env)]
        if missing:
            raise RendezvousError(
                f"megatrain: Trainer(num_nodes={num_nodes}) but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set: without them every node would take itself for node "
                f"0 on its own address and wait for the others until the timeout. {_LAUNCH_HINT}")


#: Strategy options that must be the same on every rank (public attributes of ``MegaTrainStrategy``).
STRATEGY_OPTIONS = ("lookahead", "block_group", "recompute_every", "offload_activations", "recompute", "activation_memory_limit",
                    "overlap_optimizer", "block_classes", "block_names", "cpu_zero_copy", "nvme",
                    "optimizer_in_backward", "loss_chunk_size", "mlp_chunk_size", "unfreeze_during_fit")

#: Trainer settings that change what a step does.
TRAINER_SETTINGS = ("precision", "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
                    "max_steps", "max_epochs")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()[:12]


def _stable_repr(value: Any) -> str:
    """``repr`` that is the same in every process: sets (ordered by each process's hash seed) sorted, dataclasses
    field by field."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(str(v) for v in value)) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ", ".join(f"{f.name}={_stable_repr(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__name__}({inner})"
    return repr(value)


def run_fingerprint(module: torch.nn.Module, strategy: Any, trainer: Any) -> dict[str, str]:
    """What must be equal on every rank, as short strings (key -> value).

    Keys: ``model class`` (the LightningModule's and the first submodule's with a Hugging Face ``config``),
    ``model config`` (a SHA-256 of that config's ``to_dict()`` without ``_``-keys and ``transformers_version``),
    ``parameters`` (count, elements, trainable elements and a SHA-256 of every parameter's name, shape, dtype and
    ``requires_grad``), ``strategy.<option>`` for :data:`STRATEGY_OPTIONS`, ``trainer.<setting>`` for
    :data:`TRAINER_SETTINGS`, and ``torch`` (the version).
    """
    classes = [f"{type(module).__module__}.{type(module).__qualname__}"]
    config = None
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            classes.append(type(m).__qualname__)
            # not the path it was loaded from (node-local copies differ) nor private or version keys
            config = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
            break
    params = [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]
    numel = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    fp = {
        "model class": " / ".join(classes),
        "model config": _digest(config) if config is not None else "none",
        "parameters": f"{len(params)} tensors, {numel} elements, {trainable} trainable, sha {_digest(params)}",
        "torch": torch.__version__,
    }
    for name in STRATEGY_OPTIONS:
        fp[f"strategy.{name}"] = _stable_repr(getattr(strategy.config, name))
    for name in TRAINER_SETTINGS:
        fp[f"trainer.{name}"] = repr(getattr(trainer, name, None))
    return fp


#: Keys of an optimizer's param groups that change its updates (``params`` is summarised by its count).
OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused", "capturable",
                  "differentiable", "decoupled_weight_decay")


def optimizer_fingerprint(optimizer: Any, lr_scheduler_configs: Any = ()) -> dict[str, str]:
    """What must be equal on every rank about the optimizer (class, param groups, :data:`OPTIMIZER_KEYS`) and
    Lightning's ``LRSchedulerConfig`` list (class, ``interval``, ``frequency``): each slab's owner updates with its
    own optimizer's settings, so a rank with another learning rate would silently train its slabs differently."""
    fp = {"optimizer": f"{type(optimizer).__qualname__}, {len(optimizer.param_groups)} param groups"}
    for i, g in enumerate(optimizer.param_groups):
        fp[f"optimizer.group{i}.params"] = str(len(g["params"]))
        for k in OPTIMIZER_KEYS:
            if k in g:
                fp[f"optimizer.group{i}.{k}"] = repr(g[k])
    for i, c in enumerate(lr_scheduler_configs):
        fp[f"scheduler{i}"] = (f"{type(c.scheduler).__qualname__}, interval={c.interval}, "
                               f"frequency={c.frequency}")
    return fp


def differences(fingerprints: list[Mapping[str, str]]) -> dict[str, dict[str, list[int]]]:
    """Keys whose value is not the same on every rank: key -> {value: [ranks]} (``fingerprints[r]`` is rank r's)."""
    out: dict[str, dict[str, list[int]]] = {}
    for key in sorted({k for fp in fingerprints for k in fp}):
        by_value: dict[str, list[int]] = {}
        for r, fp in enumerate(fingerprints):
            by_value.setdefault(fp.get(key, "<missing>"), []).append(r)
        if len(by_value) > 1:
            out[key] = by_value
    return out


def mismatch_message(diff: Mapping[str, Mapping[str, list[int]]]) -> str:
    """The error text for :func:`differences`' result: every differing key with each value and its ranks."""
    lines = []
    for key, by_value in diff.items():
        parts = [f"{v} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for v, rs in by_value.items()]
        lines.append(f"  {key}: " + "; ".join(parts))
    return ("megatrain: the ranks of this run were started with different configurations; every rank must run the "
            "same script with the same model and options (same command line, Hydra overrides and files on every "
            "node). Differing:\n" + "\n".join(lines)
            + ("\nstrategy.nvme: give every rank the same nvme_path; each rank keeps its files in its own "
               "<nvme_path>/megatrain_store_rank<r> (docs/guide/distributed.md, \"With the NVMe tier\")." if "strategy.nvme" in diff else ""))


def check_same_config(groups: Any, fingerprint: Mapping[str, str]) -> None:
    """Compare this rank's :func:`run_fingerprint` with every other rank's (a collective over ``groups.host``,
    the ``ProcessGroups``; a rank that died meanwhile is named).

    Raises:
        ConfigMismatchError: on every rank (:func:`mismatch_message`).
    """
    box: list[Any] = [None] * dist.get_world_size(groups.host)
    with groups.guard("the configuration check"):
        dist.all_gather_object(box, dict(fingerprint), group=groups.host)
    diff = differences(box)
    if diff:
        raise ConfigMismatchError(mismatch_message(diff))


def check_same_batches(groups: Any, batches: float) -> None:
    """Compare this rank's number of training batches per epoch (``trainer.num_training_batches``, ``inf`` without
    length, capped at ``max_steps x accumulate_grad_batches``) with every other rank's (as :func:`check_same_config`).

    A rank whose epoch ends first would wait at the end of ``fit`` for updates the owners, still in their epoch,
    publish only after their next step: a hang until ``timeout``, blamed on a live rank (DDP needs equal counts too).

    Raises:
        ConfigMismatchError: on every rank, with each rank's count.
    """
    box: list[Any] = [None] * dist.get_world_size(groups.host)
    with groups.guard("the check of the training batches per rank"):
        dist.all_gather_object(box, float(batches), group=groups.host)
    if len(set(box)) > 1:
        counts = "; ".join(f"{n:g} on rank {r}" for r, n in enumerate(box))
        raise ConfigMismatchError(
            f"megatrain: the ranks have different numbers of training batches per epoch ({counts}, counted up to "
            "max_steps x accumulate_grad_batches); every rank must "
            "run the same number of micro-batches (gradients are averaged across ranks after each micro-batch's "
            "backward, as with DDP: a rank whose epoch ended would wait for the others until `timeout`). Keep Lightning's DistributedSampler (`use_distributed_sampler=True`, the "
            "default) or give every rank a sampler of the same length, with the same `limit_train_batches`.")
