"""The streaming engine (``StreamingEngine``) and the parts it is built from; see docs/architecture.md, "Engine layout"."""

from .streaming import StreamingEngine

__all__ = ["StreamingEngine"]
