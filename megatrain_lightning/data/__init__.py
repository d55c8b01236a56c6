from .resumable import ResumableDataLoader

__all__ = ["ResumableDataLoader"]
