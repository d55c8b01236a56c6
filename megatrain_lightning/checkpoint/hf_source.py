"""Reading Hugging Face safetensors directories one tensor at a time (:class:`SafetensorsSource`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from .hf_common import INDEX_FILE, SINGLE_FILE, _PICKLE_SUFFIXES, _ST_DTYPES, CheckpointFormatError, _close


class SafetensorsSource:
    """Read single tensors from a safetensors checkpoint without loading the whole file.

    Args:
        path: a directory holding ``model.safetensors.index.json`` (+ the shards it names) or
            ``model.safetensors``, or the path of one ``.safetensors`` file.

    Every shard's header is validated here, so truncation is reported before any tensor is read.

    Raises:
        FileNotFoundError: ``path`` does not exist, a directory has neither file, or the index
            names a shard that is missing.
        CheckpointFormatError: a shard is truncated or corrupted, the index is not valid JSON,
            or a key listed in the index is not in its shard.
    """

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(
                f"Checkpoint path {p} does not exist: expected a directory holding {SINGLE_FILE} "
                f"or {INDEX_FILE} (+ its shards), or a single .safetensors file."
            )
        self._key_file: dict[str, Path] = {}
        self._file_keys: dict[Path, list[str]] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        if p.is_file():
            if p.suffix != ".safetensors":
                raise CheckpointFormatError(
                    f"{p} is not a .safetensors file. Pass a safetensors file or a Hugging Face model directory"
                    + (" (pickle checkpoints such as .bin/.pt are not loaded: convert them with "
                       "transformers' save_pretrained(safe_serialization=True))." if p.suffix in _PICKLE_SUFFIXES else ".")
                )
            self.root = p.parent
            self._files = [p]
        elif (p / INDEX_FILE).is_file():
            self.root = p
            self._files = self._read_index(p / INDEX_FILE)
        elif (p / SINGLE_FILE).is_file():
            self.root = p
            self._files = [p / SINGLE_FILE]
        else:
            present = sorted(x.name for x in p.iterdir())
            hint = ""
            if any(n.endswith(_PICKLE_SUFFIXES) for n in present):
                hint = (" It holds pickle weights (.bin/.pt), which are not loaded: re-save the model with "
                        "transformers' save_pretrained(safe_serialization=True).")
            raise FileNotFoundError(
                f"No safetensors weights in {p}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards "
                f"(found: {present[:10]}).{hint}"
            )
        for f in self._files:
            self._read_header(f)
        if not self._key_file:  # single file: the header is the key list
            for f in self._files:
                for k in self._file_keys[f]:
                    self._key_file[k] = f

    # -- construction helpers
    def _read_index(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointFormatError(f"{index} is not a valid safetensors index ({err}).") from err
        files: dict[str, Path] = {}
        for key, shard in weight_map.items():
            if Path(shard).name != shard:
                raise CheckpointFormatError(f"{index} names shard {shard!r}, which is not a plain file name.")
            f = files.setdefault(shard, index.parent / shard)
            self._key_file[key] = f
        for shard, f in files.items():
            if not f.is_file():
                raise FileNotFoundError(f"{index} names shard {shard}, which is missing from {index.parent}.")
        return list(files.values())

    def _read_header(self, f: Path) -> None:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                keys = list(h.keys())
                for k in keys:
                    s = h.get_slice(k)
                    self._meta.setdefault(k, (tuple(s.get_shape()), s.get_dtype()))
        except (SafetensorError, OSError) as err:
            raise CheckpointFormatError(f"Safetensors file {f} is truncated or corrupted: {err}") from err
        self._file_keys[f] = keys
        mine = set(keys)
        wrong = [k for k, ff in self._key_file.items() if ff == f and k not in mine]
        if wrong:
            raise CheckpointFormatError(f"The index says {wrong[:5]} are in {f}, but that file does not hold them.")

    # -- public API
    def file_of(self, key: str) -> Path:
        """The file holding ``key``. Raises KeyError (with nearby keys) if absent."""
        try:
            return self._key_file[key]
        except KeyError:
            raise KeyError(
                f"{key!r} is not in the checkpoint at {self.root} ({len(self._key_file)} tensors); "
                f"nearby keys: {_close(key, self._key_file)}"
            ) from None

    @property
    def files(self) -> list[Path]:
        return list(self._files)

    def keys(self) -> list[str]:
        """All tensor names (index order for a sharded checkpoint, file order otherwise)."""
        return list(self._key_file)

    def has(self, key: str) -> bool:
        return key in self._key_file

    __contains__ = has

    def __len__(self) -> int:
        return len(self._key_file)

    def shape(self, key: str) -> torch.Size:
        """Shape of ``key`` from the header (no data read). Raises KeyError if absent."""
        self.file_of(key)
        return torch.Size(self._meta[key][0])

    def dtype(self, key: str) -> torch.dtype:
        """Stored dtype of ``key`` from the header (no data read). Raises KeyError if absent."""
        self.file_of(key)
        name = self._meta[key][1]
        if name not in _ST_DTYPES:
            raise CheckpointFormatError(f"{key!r} has dtype {name}, which this torch build cannot represent.")
        return _ST_DTYPES[name]

    def nbytes(self, key: str) -> int:
        """Size of ``key``'s data in bytes (from the header)."""
        return self.shape(key).numel() * self.dtype(key).itemsize

    def get(self, key: str) -> torch.Tensor:
        """Load one tensor: CPU, stored dtype and shape; only this tensor's bytes are read.

        Raises:
            KeyError: ``key`` is not in the checkpoint (the message lists nearby keys).
            CheckpointFormatError: the file holding it cannot be read (names the file).
        """
        f = self.file_of(key)
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                return h.get_tensor(key)
        except (SafetensorError, OSError) as err:
            raise CheckpointFormatError(f"Cannot read {key!r} from {f} (truncated or corrupted?): {err}") from err

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, tensor)`` for every key, loading one tensor at a time."""
        for k in self.keys():
            yield k, self.get(k)

    def __repr__(self) -> str:
        return f"SafetensorsSource({str(self.root)!r}, {len(self)} tensors in {len(self._files)} file(s))"


