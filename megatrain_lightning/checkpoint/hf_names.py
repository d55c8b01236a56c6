"""Which tensor names of a model are written, and under which name each tensor is found again.

A model's ``state_dict`` may hold one tensor object under several names:

* *declared ties* (``lm_head.weight`` tied to ``model.embed_tokens.weight``): transformers lists
  them in ``model.all_tied_weights_keys`` and ties them again on load, so only the source is
  written, as ``save_pretrained`` does;
* *undeclared sharing* (``layers[2].mlp.up_proj.weight = layers[0].mlp.up_proj.weight``): nothing
  in the config re-creates it, so dropping a name would make ``from_pretrained`` initialise that
  weight at random without an error. Every such name is written (the values are equal, and
  ``from_pretrained`` loads them as independent tensors), and a warning names them once.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator

import torch

from .hf_common import _tied_targets

log = logging.getLogger(__name__)
_warned: set[tuple[str, ...]] = set()


def state_dict_entries(model: torch.nn.Module,
                       unwrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` that ``model.state_dict(keep_vars=True)`` would hold, in its order, without
    building it (the module's own tensor objects).

    Args:
        unwrap: applied to every submodule before it is read (e.g. a peft LoRA layer -> the layer it
            wraps), so the names are those of the unwrapped model; default: none.
    """
    def walk(mod: torch.nn.Module, pre: str) -> Iterator[tuple[str, torch.Tensor]]:
        if unwrap is not None:
            mod = unwrap(mod)
        for n, p in mod._parameters.items():
            if p is not None:
                yield pre + n, p
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                yield pre + n, b
        for n, child in mod._modules.items():
            if child is not None:
                yield from walk(child, f"{pre}{n}.")

    yield from walk(model, "")


def _groups(entries: Iterable[tuple[str, torch.Tensor]]) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, t in entries:
        groups.setdefault(id(t), []).append(name)
    return list(groups.values())


def saved_names(model: torch.nn.Module, entries: Iterable[tuple[str, torch.Tensor]] | None = None,
                ties: dict[str, str] | None = None) -> dict[str, str]:
    """``{state_dict name: name it is written under}``: a declared tie target whose source shares its tensor maps
    to that source; every other name maps to itself (if all names of a group are tie targets, the first is kept).

    Args:
        model: the model whose ties are declared.
        entries: ``(name, tensor)`` pairs to group (default :func:`state_dict_entries` of ``model``;
            e.g. a peft model's base weights under their Hugging Face names).
        ties: ``{tied target name: source name}`` (default: the model's declaration).
    """
    ties = _tied_targets(model) if ties is None else ties
    out: dict[str, str] = {}
    for names in _groups(state_dict_entries(model) if entries is None else entries):
        members = set(names)
        written = [n for n in names if not (n in ties and ties[n] in members)] or names[:1]
        for n in names:
            out[n] = n if n in written else written[0]
    return out


def undeclared_sharing(model: torch.nn.Module, entries: Iterable[tuple[str, torch.Tensor]] | None = None,
                       ties: dict[str, str] | None = None) -> list[list[str]]:
    """Groups of names that share one tensor object and are all written (no declared tie covers them)."""
    entries = list(state_dict_entries(model) if entries is None else entries)
    saved = saved_names(model, entries, ties)
    out = []
    for names in _groups(entries):
        written = [n for n in names if saved[n] == n]
        if len(written) > 1:
            out.append(written)
    return out


def warn_undeclared_sharing(groups: list[list[str]], model_name: str) -> None:
    """Log (once per group and process) that shared names are written as separate tensors."""
    for g in groups:
        if tuple(g) in _warned:
            continue
        _warned.add(tuple(g))
        log.warning(
            "megatrain: %s shares one tensor between %s, which its config does not declare tied; every name is "
            "written with the same values (from_pretrained loads them as separate tensors: declare the tie in the "
            "model class's _tied_weights_keys to keep it tied after loading).", model_name, " and ".join(g))
