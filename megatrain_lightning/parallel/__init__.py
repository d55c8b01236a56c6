"""Data parallel across devices and nodes on ``torch.distributed`` (docs/architecture.md, "Several GPUs and nodes")."""
