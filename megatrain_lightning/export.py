"""Export the model of a megatrain checkpoint directory as a Hugging Face model directory, or the
whole checkpoint as one Lightning ``.ckpt`` file.

    python -m megatrain_lightning.export CKPT_DIR OUT_DIR [--dtype fp32|bf16|fp16] [--max-shard-bytes N]
    python -m megatrain_lightning.export CKPT_DIR OUT_DIR --merge-adapter      # a peft (LoRA) checkpoint
    python -m megatrain_lightning.export CKPT_DIR --lightning-ckpt OUT.ckpt    # for load_from_checkpoint

CKPT_DIR is a checkpoint directory written by ``Trainer(strategy="megatrain")`` (its ``model/`` subdirectory is a
Hugging Face model directory) or a Hugging Face model directory itself. Checksums are verified first; tensors are
then streamed one at a time into OUT_DIR (cast to ``--dtype``), so memory stays at about one shard whatever the
model size. The config (``dtype`` updated, a GGUF quantization config dropped), generation config and tokenizer
files are copied. A peft checkpoint (``base_model/`` + ``adapter/``) is exported only with ``--merge-adapter``
(merged in memory). ``--lightning-ckpt``: see :mod:`megatrain_lightning.checkpoint.lightning_file`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .checkpoint.hf_config import dense_config_dict
from .checkpoint.hf_io import (CHECKSUMS_FILE, DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SafetensorsSource, add_checksums,
                               resolve_dtype, save_hf_model_dir, verify_checksums, write_safetensors_shards)
from .checkpoint.peft_io import ADAPTER_DIR, BASE_DIR

_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _model_dir(ckpt_dir: Path) -> tuple[Path, bool]:
    """(the HF model directory inside ``ckpt_dir``, whether checksums are required)."""
    if not ckpt_dir.exists():
        raise FileNotFoundError(f"Checkpoint directory {ckpt_dir} does not exist.")
    if ckpt_dir.is_file():
        raise ValueError(
            f"{ckpt_dir} is a file, not a checkpoint directory. This tool takes checkpoint directories written by "
            "Trainer(strategy='megatrain') (they hold model/config.json and safetensors weights). A .ckpt file from "
            "another strategy is a pickled Lightning checkpoint: load it into your LightningModule (e.g. "
            "MyModule.load_from_checkpoint(path), only if you trust the file) and write the Hugging Face model with "
            "transformers' module.model.save_pretrained(OUT_DIR)."
        )
    if (ckpt_dir / "model" / "config.json").is_file():
        return ckpt_dir / "model", True
    if (ckpt_dir / "config.json").is_file():
        return ckpt_dir, (ckpt_dir / CHECKSUMS_FILE).is_file()
    if (ckpt_dir / "model").is_dir():
        raise ValueError(
            f"{ckpt_dir / 'model'} has no config.json: the checkpoint was written for a LightningModule that is not "
            "exactly one Hugging Face model, so there is no model config to export. Its weights are the safetensors "
            "files in model/, keyed by parameter name (read them with megatrain_lightning.checkpoint.hf_io."
            "SafetensorsSource)."
        )
    found = sorted(p.name for p in ckpt_dir.iterdir())[:10]
    raise ValueError(
        f"{ckpt_dir} is not a checkpoint directory written by strategy='megatrain' (no model/config.json) nor a "
        f"Hugging Face model directory (no config.json); it holds {found}. For a checkpoint written by another "
        "strategy, load it into your module and use transformers' save_pretrained."
    )


def _copy_side_files(src: Path, dst: Path, dtype_name: str, dtypes: list) -> list[str]:
    """Copy config/generation/tokenizer (every non-weight) file; the config gets the written dtype and
    loses a quantization config that does not describe the written ``dtypes``. Returns the names."""
    copied = []
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name in (INDEX_FILE, CHECKSUMS_FILE) or f.name.endswith(_NOT_COPIED_SUFFIXES):
            continue
        if f.name == "config.json":
            cfg = dense_config_dict(json.loads(f.read_text()), dtypes)
            cfg["dtype"] = dtype_name
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = dtype_name
            (dst / f.name).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(f, dst / f.name)
        copied.append(f.name)
    return copied


def _peft_checkpoint(ckpt_dir: Path, merge_adapter: bool) -> bool:
    """Whether ``ckpt_dir`` is a checkpoint of a peft model; raises unless that matches ``merge_adapter``."""
    is_peft = (ckpt_dir / ADAPTER_DIR).is_dir() and (ckpt_dir / BASE_DIR).is_dir()
    if merge_adapter and not is_peft:
        raise ValueError(f"{ckpt_dir} holds no peft adapter ({ADAPTER_DIR}/ and {BASE_DIR}/): export it without "
                         "--merge-adapter.")
    if is_peft and not merge_adapter:
        raise ValueError(
            f"{ckpt_dir} is a checkpoint of a peft model: {BASE_DIR}/ holds the base weights and {ADAPTER_DIR}/ the "
            f"adapter in peft's format, and {BASE_DIR}/ alone is the model without the fine-tuning. Pass "
            "--merge-adapter (merge_adapter=True) to write the merged dense model (built in memory: it must fit in "
            f"RAM), or use the adapter as it is: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
            f"'{ckpt_dir / BASE_DIR}'), '{ckpt_dir / ADAPTER_DIR}').")
    return is_peft


def _export_merged(ckpt_dir: Path, dst: Path, dt: Any, max_shard_bytes: int) -> tuple[dict[str, Any], Path]:
    """Verify the whole checkpoint, merge its adapter with peft, write the merged model and the tokenizer."""
    from .checkpoint.directory import verified_info
    from .checkpoint.peft_io import merged_model

    verified_info(ckpt_dir)
    index = save_hf_model_dir(dst, merged_model(ckpt_dir), dtype=dt, max_shard_bytes=max_shard_bytes)
    src = ckpt_dir / BASE_DIR
    extra = [f.name for f in sorted(src.iterdir()) if f.is_file() and not (dst / f.name).exists()
             and f.name not in (INDEX_FILE, CHECKSUMS_FILE) and not f.name.endswith(_NOT_COPIED_SUFFIXES)]
    for name in extra:  # tokenizer files
        shutil.copyfile(src / name, dst / name)
    add_checksums(dst, extra)
    return index, src


def _check_out_dir(dst: Path, src_dir: Path) -> None:
    """Refuse an ``OUT_DIR`` that is not new or empty, before anything is written: mixed-in files would load stale
    tensors or config, or damage the checkpoint."""
    if not dst.exists():
        return
    if not dst.is_dir():
        raise FileExistsError(f"OUT_DIR {dst} is a file: give the path of a new or empty directory.")
    if dst.resolve() == src_dir.resolve():
        raise ValueError(f"OUT_DIR {dst} is the source model directory: choose another directory.")
    held = sorted(p.name for p in dst.iterdir())
    if held:
        raise FileExistsError(
            f"OUT_DIR {dst} is not empty (it holds {held[:5]}{' ...' if len(held) > 5 else ''}): the export writes "
            "a whole model directory and would mix its files with these. Give a new or empty directory (or remove "
            "that one first); nothing was written.")


def export(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "fp32", *,
           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, merge_adapter: bool = False,
           quiet: bool = False) -> dict[str, Any]:
    """Write the model of ``ckpt_dir`` as a Hugging Face model directory at ``out_dir``.

    Args:
        ckpt_dir: a megatrain checkpoint directory (with ``model/``) or a HF model directory.
        out_dir: created if missing; must be new or an empty directory (so not the source either).
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (floating tensors are cast; others keep their dtype).
        max_shard_bytes: shard size limit of the output, in bytes.
        merge_adapter: ``ckpt_dir`` is a peft checkpoint: write its base model with the "default" adapter merged
            by peft (``merge_and_unload``); the fp32 model is built in memory.
        quiet: print nothing (default: a summary on stdout, a note on stderr for an unverified HF directory).

    Returns:
        ``{"tensors": count, "bytes": bytes written as tensor data, "seconds": wall time,
        "out_dir": str, "files": [weight files]}``.

    Raises:
        FileNotFoundError: ``ckpt_dir`` does not exist, or has no safetensors weights.
        ValueError: ``ckpt_dir`` is a file or not a checkpoint directory, an unknown ``dtype``, a checksum
            mismatch, ``out_dir`` is the source directory, or a peft checkpoint without ``merge_adapter`` (or the
            reverse); :class:`~megatrain_lightning.checkpoint.errors.CheckpointError` for a damaged or assembled
            peft checkpoint.
        FileExistsError: ``out_dir`` is a file or a non-empty directory (nothing is written).
        ImportError: ``merge_adapter`` without peft installed.
    """
    start = time.perf_counter()
    dt = resolve_dtype(dtype)
    ckpt = Path(ckpt_dir)
    dst = Path(out_dir)
    if ckpt.is_dir() and _peft_checkpoint(ckpt, merge_adapter):
        _check_out_dir(dst, ckpt / BASE_DIR)
        index, src_dir = _export_merged(ckpt, dst, dt, max_shard_bytes)
        src_desc = f"{src_dir} with the adapter {ckpt / ADAPTER_DIR} merged"
    else:
        src_dir, need_sums = _model_dir(ckpt)
        _check_out_dir(dst, src_dir)
        if need_sums:
            verify_checksums(src_dir)
        elif not quiet:
            print(f"note: {src_dir} has no {CHECKSUMS_FILE} (not written by megatrain); exporting without "
                  "verification", file=sys.stderr)
        source = SafetensorsSource(src_dir)
        dtypes = [dt if source.dtype(k).is_floating_point else source.dtype(k) for k in source.keys()]
        index = write_safetensors_shards(dst, source.items(), max_shard_bytes=max_shard_bytes, dtype=dt)
        copied = _copy_side_files(src_dir, dst, str(dt).split(".")[1], dtypes)
        add_checksums(dst, copied)
        src_desc = str(src_dir)
    summary = {
        "tensors": len(index["weight_map"]),
        "bytes": index["metadata"]["total_size"],
        "seconds": time.perf_counter() - start,
        "out_dir": str(dst),
        "files": sorted(set(index["weight_map"].values())),
    }
    if not quiet:
        print(f"exported {summary['tensors']} tensors, {summary['bytes']} bytes ({str(dt).split('.')[1]}) from "
              f"{src_desc} to {dst} in {summary['seconds']:.2f} s")
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad input or damaged checkpoint)."""
    parser = argparse.ArgumentParser(
        prog="python -m megatrain_lightning.export",
        description="Export the model of a strategy='megatrain' checkpoint directory as a Hugging Face model "
                    "directory (safetensors) that AutoModelForCausalLM.from_pretrained loads.")
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint directory (or HF model directory)")
    parser.add_argument("out_dir", metavar="OUT_DIR", nargs="?", help="output directory (new or empty: a non-empty one is refused)")
    parser.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16")
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES,
                        help="shard size limit in bytes (default 5 GiB)")
    parser.add_argument("--merge-adapter", action="store_true",
                        help="peft (LoRA) checkpoint: write the base model with the adapter merged (in memory)")
    parser.add_argument("--lightning-ckpt", metavar="OUT.ckpt",
                        help="also/instead write a single-file Lightning checkpoint (for load_from_checkpoint; "
                             "the whole model and AdamW state are held in memory)")
    parser.add_argument("--no-optimizer", action="store_true", help="with --lightning-ckpt: weights only")
    args = parser.parse_args(argv)
    if args.out_dir is None and args.lightning_ckpt is None:
        parser.error("give OUT_DIR (a Hugging Face model directory) and/or --lightning-ckpt OUT.ckpt")
    try:
        if args.out_dir is not None:
            export(args.ckpt_dir, args.out_dir, args.dtype, max_shard_bytes=args.max_shard_bytes,
                   merge_adapter=args.merge_adapter)
        if args.lightning_ckpt is not None:
            from .checkpoint.lightning_file import convert_to_lightning_checkpoint

            res = convert_to_lightning_checkpoint(args.ckpt_dir, args.lightning_ckpt, optimizer=not args.no_optimizer)
            print(f"wrote {res['out_path']}: {res['tensors']} state_dict tensors ({res['bytes']} bytes)"
                  + (" + AdamW state" if res["optimizer"] else " (weights only)"))
            if not res["optimizer"] and not args.no_optimizer:
                print(f"warning: {args.ckpt_dir} holds no AdamW state (saved with weights_only=True, e.g. the "
                      f"recipe's final checkpoint with checkpoint.save_optimizer=false), so {res['out_path']} holds "
                      "the weights only: load_from_checkpoint works, but Trainer.fit(ckpt_path=...) cannot resume "
                      "training from it. To resume, convert a checkpoint saved with the optimizer state "
                      "(ModelCheckpoint without save_weights_only, trainer.save_checkpoint(path), or the recipe's "
                      "checkpoints/last.ckpt).", file=sys.stderr)
    except (FileNotFoundError, FileExistsError, IsADirectoryError, ValueError, ImportError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
