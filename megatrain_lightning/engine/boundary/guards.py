"""Checks that refuse or warn about user code during a block call and its backward, one entry per phase of
:class:`CallGuards` (``call``, ``forward``, ``backward``, ``recompute``, ``recomputed``); each raises ``RuntimeError``.

A block call's autograd boundary sees the tensors of its arguments and result as ``torch.utils._pytree.tree_flatten``
finds them (tuples, lists, dicts, named tuples, registered classes such as HF ``ModelOutput``). A tensor inside any
other object (a plain ``@dataclass``, a ``SimpleNamespace``) would get no gradient, silently, so such calls are
refused. Only the object's own attributes are looked at (one level), which covers the usual state containers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

RECOMPUTE_NOTE = (
    "megatrain: block {name}'s forward ran again for its backward (a recompute: recompute='block', 'selective' or "
    "'auto'), from its saved inputs, random state and module flags, but with the Python state its modules read now. "
    "If a hook or a module inside the block reads an attribute that training_step changes between two calls of the "
    "model before one backward (a mask or a steering vector set per call), the recompute sees the latest value, as "
    "under torch.utils.checkpoint. Pass such state as an argument of the model call, or use recompute='none' (the "
    "block keeps its graph: nothing runs twice).")

# PyTorch's own message for this error, so users find the usual advice
SECOND_BACKWARD = ("Trying to backward through the graph a second time (or directly access saved tensors after they "
                    "have already been freed). Saved intermediate values of the graph are freed when you call "
                    ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
                    "graph a second time")
# a retained graph backpropagated after an update of the weights it read (plain PyTorch's in-place error there)
STEPPED_SINCE = ("one of the variables needed for gradient computation has been modified by an inplace operation: "
                 "this graph, kept with retain_graph=True, is backpropagated again after the optimizer updated the "
                 "weights it read. Run every backward of a graph before optimizer.step()")


def _fields(obj: Any) -> Iterable[tuple[str, Any]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return ((f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj))
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        return d.items()
    slots = getattr(type(obj), "__slots__", ())
    return ((s, getattr(obj, s, None)) for s in ([slots] if isinstance(slots, str) else slots))


def _hidden(items: Iterable[Any], wanted) -> list[str]:
    found = []
    for x in items:
        if x is None or isinstance(x, (torch.Tensor, int, float, bool, str, bytes, type, torch.nn.Module)):
            continue
        found += [f"{type(x).__name__}.{name}" for name, v in _fields(x) if isinstance(v, torch.Tensor) and wanted(v)]
    return found


def _advice(block: str, where: str, found: list[str]) -> str:
    return (f"megatrain: streamed block {block} {where} tensors inside an object torch's pytree does not open "
            f"({', '.join(found[:4])}): the block's autograd boundary would not see them and their gradient "
            "would be lost silently. Pass/return the tensors themselves (or a tuple, list, dict or NamedTuple of "
            "them), or register the class with torch.utils._pytree.register_dataclass / register_pytree_node.")


def _in_place_edit(block: str, e: RuntimeError) -> None:
    """Re-raise torch's in-place-on-a-leaf error from a block call with what it means here (a block's tensor inputs
    are views of autograd leaves, so ``x += 1`` on one is refused). Returns for any other error.

    Raises:
        RuntimeError: naming the block and the rewrite.
    """
    if "leaf Variable that requires grad is being used in an in-place operation" in str(e):
        raise RuntimeError(
            f"megatrain: streamed block {block} modifies one of its tensor inputs in place (e.g. `x += 1` or "
            "`x.add_(...)` on an argument): the strategy passes a block's inputs as views of autograd leaves, which "
            "torch does not let be modified in place. Write it out of place inside the block (`x = x + 1`).") from e


class CallGuards:
    """The per-call checks of one engine's block calls, one entry per phase (module docstring).

    Args:
        store: the host store (``index``: ``id(param)`` -> (slab, entry); ``slabs[s].entries[e].ref.fqn``), to
            name a parameter in the foreign-leaf refusal (:meth:`forward`).
    """

    def __init__(self, store: Any):
        self.store = store
        self.checked: set[int] = set()  # blocks whose graph the foreign-leaf check walked
        self.hooks_seen = RemovableHandle.next_id  # hook handles made so far (any module, tensor or global hook)
        self.hook_warnings: set[str] = set()  # blocks warned about forward hooks inside them (block_state.snapshot)

    @contextlib.contextmanager
    def call(self, name: str, rest: Iterable[Any]) -> Iterator[None]:
        """Around a grad-mode call of block ``name`` (``rest``: non-tensor leaves of its flattened arguments).

        Raises:
            RuntimeError: under a ``torch.func`` transform; a tensor that requires grad hidden in an argument
                object; the block modifies a tensor input in place."""
        if torch._C._are_functorch_transforms_active():  # an autograd.Function with host-side state
            raise RuntimeError(f"megatrain: streamed block {name} was called under a torch.func transform (grad, "
                               "vmap, jacrev...), which the strategy's block calls do not support; use "
                               "torch.autograd.grad, or strategy='auto'.")
        found = _hidden(rest, lambda t: t.requires_grad)  # a tensor hidden in an object would get no gradient
        if found:
            raise RuntimeError(_advice(name, "was called with", found))
        try:
            yield
        except RuntimeError as e:
            _in_place_edit(name, e)
            raise

    def forward(self, block: Any, flat: Sequence[Any], outs: Sequence[torch.Tensor],
                own: Sequence[torch.Tensor]) -> None:
        """After the training forward of ``block``: ``flat`` its flattened result, ``outs`` its tensors (still
        attached to the call's graph), ``own`` the call's input and parameter leaves.

        The foreign-leaf check refuses outputs that depend on a tensor that requires grad and is neither an argument
        nor a block parameter (an outside module's parameter read by a hook inside the block, an attribute, a
        closure): its gradient would be lost silently (a steering vector read in a hook on an inner MLP trained
        6.5e-2 off plain PyTorch). It walks the call's graph at each block's first training call, and again for
        every block after any hook was registered anywhere (``RemovableHandle.next_id`` moved), so a hook added
        mid-fit is seen.

        Raises:
            RuntimeError: a leaf outside the call reached ``outs`` (naming the block and the tensor, its parameter
                name when the store holds it); a floating-point tensor hidden in a result object."""
        if RemovableHandle.next_id != self.hooks_seen:  # a hook was registered since: check every block again
            self.hooks_seen = RemovableHandle.next_id
            self.checked.clear()
        if block.index not in self.checked:
            self.checked.add(block.index)
            self._foreign_leaves(block, outs, {id(t) for t in own})
        found = _hidden([x for x in flat if not isinstance(x, torch.Tensor)], lambda t: t.is_floating_point())
        if found:
            raise RuntimeError(_advice(block.name, "returned", found))

    def _foreign_leaves(self, block: Any, outs: Sequence[torch.Tensor], own_ids: set[int]) -> None:
        seen: set = set()
        stack = [o.grad_fn for o in outs if o.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
            if var is not None and id(var) not in own_ids:
                raise RuntimeError(
                    f"megatrain: the forward of streamed block {block.name} used {self._describe(var)}, which requires "
                    "grad and is neither an argument of the block nor one of its parameters (a parameter of a module "
                    "outside the block, read by a forward hook inside it or through an attribute); the block's "
                    "backward differentiates its arguments and parameters only, so its gradient would be lost. Pass "
                    "it to the block as an argument, make its module a submodule of the block, or register the hook "
                    "on the block itself (its outputs are differentiated as in plain PyTorch).")
            stack.extend(f for f, _ in fn.next_functions)

    def _describe(self, t: torch.Tensor) -> str:
        where = self.store.index.get(id(t))
        if where is not None:
            return f"parameter {self.store.slabs[where[0]].entries[where[1]].ref.fqn}"
        return f"a tensor of shape {list(t.shape)} ({t.dtype})"

    @contextlib.contextmanager
    def backward(self, call: Any, leaf_refs: Sequence) -> Iterator[None]:
        """Around the backward of block call ``call`` (``leaf_refs``: the parameters whose gradient it computes).

        Raises:
            RuntimeError: ``create_graph=True``; the call's saved inputs were freed by an earlier backward
                (PyTorch's message); its kept graph was closed by an optimizer step since; the block modifies a
                tensor input in place."""
        name = call.block.name
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"megatrain: backward(create_graph=True) (double backward, e.g. a gradient penalty) reached "
                f"streamed block {name}; streamed blocks are differentiated once. Compute the "
                "penalty with strategy='auto' or without create_graph."
            )
        if call.freed:
            raise RuntimeError(SECOND_BACKWARD + f" (megatrain: streamed block {name}).")
        if call.graph is not None and any(id(r.param) not in call.graph.leaves for r in leaf_refs):
            raise RuntimeError(STEPPED_SINCE + f" (megatrain: streamed block {name}).")
        try:
            yield
        except RuntimeError as e:
            _in_place_edit(name, e)
            raise

    @contextlib.contextmanager
    def recompute(self, call: Any) -> Iterator[None]:
        """Around a recompute of ``call``: an exception in it (often a user's hook reading state set for another call)
        gets ``RECOMPUTE_NOTE`` (Python >= 3.11).

        Raises:
            RuntimeError: the call's inputs were freed by an earlier backward; an input kept by reference was
                modified in place after the forward."""
        if call.freed:
            raise RuntimeError(SECOND_BACKWARD + f" (megatrain: block {call.block.name} is recomputed from freed inputs).")
        for i, version in call.versions.items():
            if call.saved[i]._version != version:
                raise RuntimeError(
                    f"megatrain: input {i} of block {call.block.name} was modified in place after the block's "
                    "forward; its recompute would be wrong. Make the operation after the block out of place."
                )
        try:
            yield
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(RECOMPUTE_NOTE.format(name=call.block.name))
            raise

    @staticmethod
    def recomputed(call: Any, out: Any) -> list[torch.Tensor]:
        """The tensor outputs of ``call``'s recompute (``out``), checked against the forward's shapes and dtypes as
        ``torch.utils.checkpoint`` checks.

        Raises:
            RuntimeError: a count, shape or dtype differs (the forward read state that changed since)."""
        flat = tree_flatten(out)[0]
        outs = [flat[i] if i < len(flat) else None for i in call.out_pos]
        got = [(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else None for o in outs]
        if len(flat) != len(call.out_flat) or (call.out_meta and got != call.out_meta):
            raise RuntimeError(
                f"megatrain: block {call.block.name} recomputed for its backward returned outputs of other shapes or "
                f"dtypes than its forward did (forward: {call.out_meta}; recompute: {got}). "
                + RECOMPUTE_NOTE.format(name=call.block.name))
        return outs  # type: ignore[return-value]
