"""Parameter counts per streamed block, read off the real model built on the meta device.

``count_params`` builds ``transformers.AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` (real
shapes, no storage: a 100B-parameter model costs a second and a few MB of RAM), so the counts are exactly what the
engine stores, tied parameters counted once, in the first block that uses them (the rule of ``blocks.py``).

Grouping (docs/architecture.md, "A training step", step 1): the decoder layers are the outermost modules whose
class is in the model's ``_no_split_modules``; every parameter met (in module order) before the first layer
belongs to the *embedding* group, every one after the last layer to the *head* group (final norm + LM head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (numbers of scalars, not bytes) of one causal LM, per streamed block.

    Attributes:
        model_type: ``config.model_type`` (``"llama"``...).
        embedding: parameters stored in the embedding block (with the tied output embedding).
        layers: parameters of each decoder layer, in order.
        head: parameters stored in the head block (final norm + LM head), tied ones excluded.
        tied: parameters the head reads from the embedding's storage (0 when untied).
        hidden_size, num_layers, vocab_size, intermediate_size, num_heads, num_kv_heads,
        head_dim: shapes used by the activation and FLOP estimates.
        castable: per stored block (embedding, each layer, head), its own parameters that autocast casts at
            every use (:func:`megatrain_lightning.engine.wire.autocast_casts`, for every module holding it): the
            ones that travel in bf16/fp16 under the mixed precisions; the rest travel in fp32. Aligned with
            :attr:`block_reads` (a tied weight is read by the embedding lookup too, so never castable).
        experts_per_token: MoE experts each token passes through (``num_experts_per_tok``; 1 for a dense MLP).
        max_position_embeddings: the longest sequence the model's positions allow (0: unknown).
        head_refetched: parameters of the head group outside the LM head module (the final norm): their own
            block, which the backward fetches again (only the LM head keeps its graph).
        expert_params: parameters of routed MoE experts, all layers (under a module named ``experts``; a shared
            expert is not routed); ``num_experts``: experts per layer (0 for a dense model). A token's matmuls
            read only ``experts_per_token / num_experts`` of them (:attr:`matmul_params`), while every block
            stores and streams all of them.
        shapes: ``(kind, shape)`` of every unique parameter in module order, ``kind`` the block group that stores
            it (``"embedding"``, ``"layer"``, ``"head"``), for shape-dependent optimizer state (:mod:`.optimizers`).
    """

    model_type: str
    embedding: int
    layers: tuple[int, ...]
    head: int
    tied: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    castable: tuple[int, ...] = ()
    experts_per_token: int = 1
    max_position_embeddings: int = 0
    head_refetched: int = 0
    expert_params: int = 0
    num_experts: int = 0
    shapes: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), repr=False)

    @property
    def stored(self) -> tuple[int, ...]:
        """Parameters each block stores in its slab (embedding, layers..., head; tied counted once)."""
        return (self.embedding, *self.layers, self.head)

    @property
    def largest_slab(self) -> int:
        """Parameters of the largest slab (the engine's D2H staging size, ``store.max_slab_numel``)."""
        return max(self.stored)

    @property
    def total(self) -> int:
        """Unique parameters (tied counted once): what the host store holds."""
        return self.embedding + sum(self.layers) + self.head

    @property
    def layer_total(self) -> int:
        return sum(self.layers)

    @property
    def head_reads(self) -> int:
        """Parameters the head block needs on the device (its own + the tied embedding)."""
        return self.head + self.tied

    @property
    def block_reads(self) -> tuple[int, ...]:
        """Parameters each streamed block reads, in forward order (tied counted per reader)."""
        return (self.embedding, *self.layers, self.head_reads)

    @property
    def reads_per_pass(self) -> int:
        """Parameters fetched to the device by one pass over all blocks."""
        return sum(self.block_reads)

    @property
    def largest_block(self) -> int:
        """Parameters of the largest block on the device at once (tied weights included)."""
        return max(self.block_reads)

    @property
    def idle_expert_params(self) -> int:
        """Routed experts' parameters a token does not pass through (0 for a dense model)."""
        if not self.num_experts or not self.expert_params:
            return 0
        return self.expert_params - self.expert_params * min(self.experts_per_token, self.num_experts) // self.num_experts

    @property
    def layer_active(self) -> int:
        """Decoder-layer parameters one token's matmuls read (all of them for a dense model)."""
        return self.layer_total - self.idle_expert_params

    @property
    def matmul_params(self) -> int:
        """Kaplan et al.'s N: the parameters a token's forward multiplies by (not the input embedding, a lookup,
        unless tied to the LM head; only the routed experts a token passes through)."""
        lookup = self.embedding - self.tied
        return self.total - lookup - self.idle_expert_params

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "total": self.total, "embedding": self.embedding,
                "layers": list(self.layers), "head": self.head, "tied": self.tied,
                "largest_block": self.largest_block}


def _hf_config(config: Mapping[str, Any] | Any) -> Any:
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        return config
    cfg = dict(config)
    if "model_type" not in cfg:
        raise ValueError(f"model config needs a model_type (transformers.AutoConfig.for_model); got keys {sorted(cfg)}")
    return transformers.AutoConfig.for_model(**cfg)


_PRETRAINED_CACHE: dict[tuple[type, str], ParamCounts] = {}


def count_params(config: Mapping[str, Any] | Any) -> ParamCounts:
    """Count the parameters of a causal LM per block, from its config alone (built on the meta device).

    Args:
        config: kwargs of ``transformers.AutoConfig.for_model`` (``model_type`` required; the ``config:`` section
            of a ``conf/model/*.yaml``), a ``PretrainedConfig``, or a built ``nn.Module``.
    """
    if isinstance(config, nn.Module):
        return count_module(config)
    import transformers

    hf = _hf_config(config)
    key = (type(hf), hf.to_json_string(use_diff=False))
    if key not in _PRETRAINED_CACHE:
        if len(_PRETRAINED_CACHE) > 32:
            _PRETRAINED_CACHE.clear()
        with torch.device("meta"):
            _PRETRAINED_CACHE[key] = count_module(transformers.AutoModelForCausalLM.from_config(hf))
    return _PRETRAINED_CACHE[key]


def _outermost_layers(model: nn.Module, classes: set[str]) -> list[str]:
    names: list[str] = []
    for name, mod in model.named_modules():
        if type(mod).__name__ in classes and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    return names


def count_module(model: nn.Module) -> ParamCounts:
    """:func:`count_params` for a built model (meta, CPU or any device: only shapes are read)."""
    classes: set[str] = set()
    for mod in model.modules():
        classes.update(getattr(mod, "_no_split_modules", None) or [])
    layer_names = _outermost_layers(model, classes)
    if not layer_names:
        raise ValueError(f"{type(model).__name__}: no decoder layer found (no module of classes {sorted(classes)}).")
    index = {n: i for i, n in enumerate(layer_names)}
    tied = head_refetched = 0
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out_name = next((n for n, m in model.named_modules() if m is out), None) if out is not None else None
    seen: dict[int, str] = {}  # id(param) -> group that stores it
    owner_ok: dict[int, bool] = {}  # id(param) -> autocast casts it at every use, in every module holding it
    from ..engine.wire import autocast_casts

    for mod in model.modules():
        for attr, p in mod.named_parameters(recurse=False):
            owner_ok[id(p)] = owner_ok.get(id(p), True) and autocast_casts(mod, attr)
    stored = [0] * (len(layer_names) + 2)  # per block: embedding, each layer, head
    cast = [0] * len(stored)
    after_layers = False  # named_parameters follows module (= forward) order
    experts = 0
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for fqn, p in model.named_parameters(remove_duplicate=False):
        group: int | str | None = None
        parts = fqn.split(".")
        for k in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:k])
            if prefix in index:
                group = index[prefix]
                after_layers = True
                break
        if group is None:
            group = "head" if after_layers else "embedding"
        n = p.numel()
        if id(p) in seen:
            if group == "head" and seen[id(p)] == "embedding":
                tied += n
            continue
        seen[id(p)] = "layer" if isinstance(group, int) else group
        shapes.append((seen[id(p)], tuple(p.shape)))
        slot = group + 1 if isinstance(group, int) else 0 if group == "embedding" else -1
        stored[slot] += n
        cast[slot] += n if owner_ok.get(id(p), False) else 0
        experts += n if isinstance(group, int) and "experts" in parts[:-1] else 0
        if group == "head" and out_name is not None and not fqn.startswith(out_name + "."):
            head_refetched += n
    cfg = getattr(model, "config", None)

    def get(*keys: str, default: int = 0) -> int:
        for k in keys:
            v = getattr(cfg, k, None)
            if v is not None:
                return int(v)
        return default

    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head", default=1)
    return ParamCounts(
        model_type=str(getattr(cfg, "model_type", type(model).__name__)),
        embedding=stored[0], layers=tuple(stored[1:-1]), head=stored[-1], tied=tied,
        hidden_size=hidden, num_layers=len(layer_names), vocab_size=get("vocab_size"),
        intermediate_size=get("intermediate_size", "n_inner", default=4 * hidden),
        num_heads=heads, num_kv_heads=get("num_key_value_heads", default=heads),
        head_dim=get("head_dim", default=hidden // max(heads, 1)),
        castable=tuple(cast),
        experts_per_token=get("num_experts_per_tok", "moe_topk", default=1),
        max_position_embeddings=get("max_position_embeddings", "n_positions", default=0),
        head_refetched=head_refetched,
        expert_params=experts,
        num_experts=get("num_local_experts", "num_experts", "n_routed_experts") if experts else 0,
        shapes=tuple(shapes),
    )
