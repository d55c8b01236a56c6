"""The autograd boundary of a streamed block: one call from its proxy to its backward (its files:
docs/architecture.md, "Engine layout"; :class:`~.boundary.Boundary` owns the rest).

Submodules are imported directly (``recompute_policy`` reads ``forward`` and ``kept``).
"""
