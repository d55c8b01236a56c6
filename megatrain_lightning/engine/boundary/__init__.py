"""The autograd boundary of a streamed block: one call from its proxy to its backward.

* ``boundary.py``: :class:`~.boundary.Boundary`, the owner: a grad-mode call through the autograd function, the
  forward records, saved inputs, recompute chains and the backward of each call;
* ``records.py``: what one call keeps for its backward (:class:`~.records.BlockCall`) and the calls of one
  forward (:class:`~.records.ForwardRecord`);
* ``kept.py``: graphs kept from a forward to its backward (the last block's; ``recompute="none"`` without weights);
* ``forward.py``: grad mode in a block's forward without keeping what its backward reads;
* ``backward.py``: what the running backward does with a leaf; a container's own parameters (``BoundParams``);
* ``runner.py``: acquire -> bind -> run -> release of a block's weights (:class:`~.runner.BlockRunner`);
* ``guards.py``: the checks that refuse or warn about user code, one entry per phase.

Submodules are imported directly (``recompute_policy`` reads ``forward`` and ``kept``).
"""
