"""Parameter counts per streamed block, read off the real model built on the meta device.

``count_params`` instantiates ``transformers.AutoModelForCausalLM.from_config`` under
``torch.device("meta")``: every module and parameter exists with its real shape, but no
storage is allocated, so a 100B-parameter model costs a second and a few MB of RAM. The
counts are therefore exactly what the engine will store (no hand-written formula per
architecture), with tied parameters (``lm_head.weight is embed_tokens.weight``) counted
once, in the first block that uses them -- the rule of ``blocks.py``.

Grouping (docs/architecture.md, "A training step", step 1): the decoder layers are the
outermost modules whose class is in the model's ``_no_split_modules``; every parameter met (in
module order) before the first layer belongs to the *embedding* group, every one after the last
layer to the *head* group (final norm + LM head).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (numbers of scalars, not bytes) of one causal LM, per streamed block.

    Attributes:
        model_type: ``config.model_type`` (``"llama"``...).
        embedding: parameters stored in the embedding block (input embedding, and the tied
            output embedding when tied).
        layers: parameters of each decoder layer, in order.
        head: parameters stored in the head block (final norm + LM head), tied ones excluded.
        tied: parameters the head reads from the embedding's storage (0 when untied).
        hidden_size, num_layers, vocab_size, intermediate_size, num_heads, num_kv_heads,
        head_dim: shapes used by the activation and FLOP estimates.
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
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the input embedding is a lookup:
        it costs no FLOPs unless it is tied to the LM head, which is a matmul)."""
        lookup = self.embedding - self.tied
        return self.total - lookup

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


@functools.lru_cache(maxsize=32)
def _count_from_json(cfg_json: str) -> ParamCounts:
    import transformers

    hf = _hf_config(json.loads(cfg_json))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    return count_module(model)


def count_params(config: Mapping[str, Any] | Any) -> ParamCounts:
    """Count the parameters of a causal LM per block, from its config alone.

    Args:
        config: kwargs of ``transformers.AutoConfig.for_model`` (``model_type`` required; the
            ``config:`` section of a ``conf/model/*.yaml``), a ``PretrainedConfig``, or an
            already built ``nn.Module`` (e.g. the model inside a LightningModule at ``setup()``).

    Returns:
        :class:`ParamCounts` of the model built on the meta device (no memory allocated).
    """
    if isinstance(config, nn.Module):
        return count_module(config)
    if isinstance(config, Mapping):
        return _count_from_json(json.dumps(dict(config), sort_keys=True))
    import transformers

    with torch.device("meta"):
        return count_module(transformers.AutoModelForCausalLM.from_config(_hf_config(config)))


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
    layers = [0] * len(layer_names)
    embedding = head = tied = 0
    seen: dict[int, str] = {}  # id(param) -> group that stores it
    after_layers = False  # named_parameters follows module (= forward) order
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
        if isinstance(group, int):
            layers[group] += n
        elif group == "embedding":
            embedding += n
        else:
            head += n
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
        embedding=embedding, layers=tuple(layers), head=head, tied=tied,
        hidden_size=hidden, num_layers=len(layers), vocab_size=get("vocab_size"),
        intermediate_size=get("intermediate_size", "n_inner", default=4 * hidden),
        num_heads=heads, num_kv_heads=get("num_key_value_heads", default=heads),
        head_dim=get("head_dim", default=hidden // max(heads, 1)),
    )
