"""The strategy's checkpoint hooks (``MegaTrainStrategy.save_checkpoint``, ``load_checkpoint``... hand their work
to :class:`StrategyCheckpoints`): directory checkpoints through :mod:`.directory`, another strategy's ``.ckpt``
through Lightning's own loader and :mod:`.lightning_resume`, and the saves deferred to the end of an optimizer step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from lightning import __version__ as lightning_version
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ..placeholder_guard import keys_only
from .atomic import check_name_length
from .atomic import remove as remove_entry
from .directory import load_checkpoint_dir, load_optimizer_dir, save_checkpoint_dir
from .errors import CheckpointError
from .lightning_resume import load_lightning_optimizer, load_lightning_weights
from .location import is_local, local_path

FABRIC_KEY = "megatrain_fabric"
"""``trainer.pt`` key of a checkpoint written by ``fabric.save``: ``{"module": name, "optimizer": name}`` in its
state."""
VERSION_KEY = "pytorch-lightning_version"
PRECISION_KEY = "MegaTrainPrecision"
"""``trainer.pt`` key of the precision plugin's state (the key the Trainer writes and restores)."""


class StrategyCheckpoints:
    """Checkpoint save/load of ``strategy`` (its ``engine``, ``lightning_module``, ``flush()``, ``checkpoint_io``
    and ``is_global_zero`` are read when a hook runs). ``writers()``: the data-parallel ``CheckpointWriters`` (each
    rank writes its own slabs) or ``None``; ``share_written()``: the node's other ranks see the weights written.

    Attributes:
        deferred: ``(filepath, weights_only)`` of the saves asked for mid-backward, in order (:meth:`defer`).
        loaded_path / loaded_meta: the directory checkpoint :meth:`load` read, and its metadata.
        loaded_file: the plain ``.ckpt`` file :meth:`load` read (Lightning's loader), or ``None``.
    """

    def __init__(self, strategy: Any, writers: Callable[[], Any], share_written: Callable[[], None]) -> None:
        self.strategy = strategy
        self.writers = writers
        self.share_written = share_written
        self.deferred: list[tuple[Any, bool]] = []
        self.loaded_path: str | None = None
        self.loaded_meta: dict[str, Any] | None = None
        self.loaded_file: str | None = None

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write a directory checkpoint (:func:`~megatrain_lightning.checkpoint.directory.save_checkpoint_dir`),
        or defer it (:meth:`defer`).

        Raises:
            TypeError: ``storage_options`` given (there is no CheckpointIO for directories).
            CheckpointError, OSError: as ``save_checkpoint_dir``; or the checkpoint holds Lightning's
                ``WeightAveraging`` average in place of the module's weights.
        """
        st = self.strategy
        if storage_options is not None:
            raise TypeError("strategy='megatrain' writes directory checkpoints and takes no storage_options.")
        if st.engine is None or st.lightning_module is None:
            raise RuntimeError("save_checkpoint called before the megatrain strategy was set up, or after "
                               "trainer.strategy.close().")
        filepath = local_path(filepath)
        st.engine.stopped.check("saving a checkpoint", CheckpointError)
        check_name_length(Path(filepath))
        if st.engine.grads.step_partly_applied():
            return self.defer(checkpoint, filepath)
        if "current_model_state" in checkpoint:  # Lightning's WeightAveraging put its average in state_dict
            raise CheckpointError(
                "megatrain: the checkpoint's state_dict holds averaged weights (Lightning's WeightAveraging / "
                "EMAWeightAveraging moved the module's own weights to 'current_model_state'); the directory "
                "checkpoint writes the weights from the host store and would save the module's weights, not the "
                "average, and could not be resumed. Drop the averaging callback or the checkpointing (ModelCheckpoint, "
                "Tuner) for this run; the average is in the module after fit (WeightAveraging copies it in at "
                "on_train_end): save it then with save_pretrained or torch.save(module.state_dict(), path).")
        st.flush()
        st.engine.params.write_back_materialized()  # weights edited after fit (NVMe tier) are what gets saved
        coop = self.writers()  # several processes: each rank writes its own slabs; Trainer's barrier follows
        tokenizer = getattr(st.lightning_module, "tokenizer", None)
        if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
            rank_zero_warn(f"megatrain: the module's `tokenizer` attribute ({type(tokenizer).__name__}) has no "
                           "save_pretrained: it is not written into the checkpoint's model/ folder (a Hugging Face "
                           "tokenizer there would be).")
            tokenizer = None
        with keys_only():  # the writer reads values from the store; peft lists some keys through state_dict()
            save_checkpoint_dir(filepath, checkpoint, st.lightning_module, st.engine, tokenizer=tokenizer, coop=coop)

    def defer(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Defer a save asked for while an ``optimizer_in_backward`` backward has updated only part of the model
        (from a backward hook or a signal handler such as SLURM auto-requeue): resumed, that step would be applied
        twice to part of the model (weights 40% off). During fit it is written by :meth:`save_deferred` at the end
        of this optimizer step (the first callback's ``on_train_batch_end``, where ``ModelCheckpoint`` saves too),
        in the order asked (a second save to one path replaces the first).

        Raises:
            CheckpointError: not during fit (e.g. an emergency save after an error mid-backward): no consistent
                checkpoint can be made.
        """
        trainer = self.strategy.lightning_module.trainer
        if trainer is None or trainer.state.status != TrainerStatus.RUNNING or not trainer.training:
            raise CheckpointError(
                "megatrain: the last optimizer step stopped in the middle of its backward after optimizer_in_backward "
                "had updated part of the model, so the weights mix two steps and no consistent checkpoint can be "
                "written. Resume from the last checkpoint (set optimizer_in_backward=False to keep every update until "
                "the backward ends).")
        self.deferred = [s for s in self.deferred if s[0] != filepath]
        self.deferred.append((filepath, "optimizer_states" not in checkpoint))
        rank_zero_warn(f"megatrain: save_checkpoint({str(filepath)!r}) was called in the middle of a backward that "
                       "applies the optimizer updates as it goes (optimizer_in_backward): part of the model is already "
                       "at the next step. It is written at the end of this optimizer step instead (one step later); "
                       "if the step does not finish, nothing is written.")

    def drop_deferred(self) -> None:
        """Forget the saves :meth:`defer` put off (asked for in a step that was stopped: never written)."""
        self.deferred = []

    def save_deferred(self, trainer: Any) -> None:
        """Write the checkpoints :meth:`defer` put off, in order, once the optimizer step is complete."""
        saves, self.deferred = self.deferred, []
        for filepath, weights_only in saves:
            trainer.save_checkpoint(filepath, weights_only=weights_only)

    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a directory checkpoint's tensors here, honouring ``LightningModule.strict_loading``, and return its
        metadata (``state_dict == {}``: :func:`~megatrain_lightning.checkpoint.directory.load_checkpoint_dir`); or
        read a plain Lightning ``.ckpt`` file with Lightning's own loader, whose weights and AdamW state
        :meth:`load_model_state_dict` and :meth:`load_optimizer_state_dict` then copy into the store.

        Raises:
            CheckpointError: as ``load_checkpoint_dir``; a ``.ckpt`` whose keys or shapes do not fit the module
                (raised when its weights are loaded).
        """
        st = self.strategy
        if st.engine is None or st.lightning_module is None:
            raise RuntimeError("load_checkpoint called before the megatrain strategy was set up.")
        st.flush()
        if st.engine.optimizer is not None:
            st.engine.optimizer.drop_pending()
        remote_file = not is_local(checkpoint_path) and get_filesystem(checkpoint_path).isfile(checkpoint_path)
        if not remote_file:
            checkpoint_path = local_path(checkpoint_path)
        if remote_file or Path(checkpoint_path).is_file():  # another strategy's .ckpt: Lightning's own loader
            self.loaded_path, self.loaded_meta = None, None
            self.loaded_file = str(checkpoint_path)
            # onto the CPU (Lightning's default keeps a GPU-saved tensor on the GPU), given as a device, not a
            # function: torch rebuilds tensor subclasses (torchao's 8-bit optimizer state) only with a device
            return st.checkpoint_io.load_checkpoint(checkpoint_path, map_location="cpu", weights_only=weights_only)
        self.loaded_file = None
        meta = load_checkpoint_dir(checkpoint_path, st.lightning_module, st.engine,
                                   strict=getattr(st.lightning_module, "strict_loading", True))
        self.share_written()
        st.engine.stopped.restored()
        self.loaded_path = checkpoint_path
        self.loaded_meta = meta
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Copy a plain ``.ckpt``'s ``state_dict`` into the store (``load_lightning_weights``); a directory
        checkpoint's weights were loaded by :meth:`load`."""
        st = self.strategy
        if self.loaded_file is not None and st.engine is not None:
            st.flush()
            load_lightning_weights(checkpoint, st.lightning_module, st.engine, strict=strict, source=self.loaded_file)
            st.engine.stopped.restored()
            self.share_written()

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load the AdamW state and param groups of the checkpoint :meth:`load` read.

        A ``BaseFinetuning`` callback re-adds its param groups in ``on_fit_start`` after its ``load_state_dict``,
        but with ``restore_checkpoint_after_setup`` Lightning restores callbacks after ``on_fit_start``, so that hook
        runs again here, before the groups are matched."""
        st = self.strategy
        if st.engine is None or st.engine.optimizer is None or (self.loaded_path is None and self.loaded_file is None):
            return
        trainer = st.lightning_module.trainer
        for cb in trainer.callbacks:
            if isinstance(cb, BaseFinetuning):
                cb.on_fit_start(trainer, st.lightning_module)
        if self.loaded_file is not None:
            load_lightning_optimizer(checkpoint, st.engine.optimizer, source=self.loaded_file)
            return
        load_optimizer_dir(self.loaded_path, st.lightning_module, st.engine, self.loaded_meta)

    # ------------------------------------------------------------------ Fabric
    def save_fabric(self, path: Any, state: Mapping[str, Any], precision_state: Mapping[str, Any],
                    filter: Any = None) -> None:
        """``fabric.save(path, state)``: the same directory checkpoint as ``trainer.save_checkpoint``, so either
        strategy resumes it. ``state`` maps names to the module set up and its optimizer (written from the host
        store), objects with ``state_dict()`` and plain values (into ``trainer.pt``); every LR scheduler's state is
        also listed under ``lr_schedulers`` (what the Trainer restores). ``precision_state``: the precision
        plugin's ``state_dict()`` (16-mixed's loss scale), kept under ``MegaTrainPrecision``.

        Raises:
            ValueError: ``filter`` given (a directory checkpoint writes every tensor of the module), or a module or
                optimizer in ``state`` that the strategy does not train.
            CheckpointError, OSError: as :meth:`save`.
        """
        st = self.strategy
        if filter:
            raise ValueError("megatrain: fabric.save(..., filter=...) is not supported: the directory checkpoint "
                             "writes every tensor of the module from the host store. Save without filter (and drop "
                             "what you do not need when exporting: python -m megatrain_lightning.export).")
        if st.engine is None:
            raise RuntimeError("fabric.save called before fabric.setup(model, optimizer) with strategy='megatrain'.")
        checkpoint: dict[str, Any] = {"state_dict": {}}
        names: dict[str, str] = {}
        schedulers = []
        for key, obj in state.items():
            role = self._role(obj)
            if role is not None:
                names[role] = key
                if role == "optimizer":
                    checkpoint["optimizer_states"] = [{}]  # written from the host store
                continue
            if isinstance(obj, LRScheduler):
                schedulers.append(obj.state_dict())
            checkpoint[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        checkpoint[FABRIC_KEY] = names
        checkpoint.setdefault("lr_schedulers", schedulers)
        checkpoint.setdefault(VERSION_KEY, lightning_version)  # what Lightning's resume reads first
        if precision_state:
            checkpoint[PRECISION_KEY] = dict(precision_state)
        self.save(checkpoint, path)

    def load_fabric(self, path: Any, state: Any, precision: Any, strict: bool = True,
                    weights_only: bool | None = None) -> dict[str, Any]:
        """``fabric.load(path, state)``: restore the entries of ``state`` in place from a directory checkpoint of
        either strategy or another Fabric strategy's one-file checkpoint (``state`` may also be the module or its
        optimizer alone: ``fabric.load_raw``). Objects with ``load_state_dict`` get theirs, plain values are
        replaced; an LR scheduler missing by name takes the Trainer's ``lr_schedulers`` entry of its rank.
        ``precision``: the precision plugin (its loss scale is restored). Returns what ``state`` did not ask for.

        Raises:
            ValueError: ``state`` is empty or names no module trained by the strategy.
            KeyError: ``strict`` and an entry of ``state`` is not in the checkpoint.
            CheckpointError: as :meth:`load`; the optimizer is asked for and the checkpoint has no AdamW state.
        """
        st = self.strategy
        if isinstance(state, (nn.Module, Optimizer)):  # fabric.load_raw: a plain state dict in one file
            role = self._role(state)
            raw = st.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            if role == "module":
                st.flush()
                load_lightning_weights({"state_dict": raw}, st.lightning_module, st.engine, strict=strict,
                                       source=str(path))
                st.engine.stopped.restored()
                self.share_written()
            elif role == "optimizer":
                st.flush()
                load_lightning_optimizer({"optimizer_states": [raw]}, st.engine.optimizer, source=str(path))
            return {}
        if not isinstance(state, Mapping) or not state:
            raise ValueError("megatrain: fabric.load(path, state) needs the state to restore, e.g. "
                             "{'model': model, 'optimizer': optimizer}: a directory checkpoint's tensors go straight "
                             "into the strategy's host store, not into a returned dict. To read the weights, "
                             "load the checkpoint's model/ folder with from_pretrained or safetensors.")
        roles = {key: self._role(obj) for key, obj in state.items()}
        if "module" not in roles.values():
            raise ValueError("megatrain: the state given to fabric.load holds no module set up with this strategy.")
        meta = self.load(path, weights_only)
        if self.loaded_file is not None:  # a one-file checkpoint: the module's and optimizer's entries by name
            for key, role in roles.items():
                if role == "module":
                    self.load_model_state_dict({"state_dict": meta.pop(key)}, strict)
                elif role == "optimizer":
                    load_lightning_optimizer({"optimizer_states": [meta.pop(key)]}, st.engine.optimizer,
                                             source=self.loaded_file)
        elif "optimizer" in roles.values():
            if "optimizer_states" not in meta:
                raise CheckpointError(f"{path} holds no optimizer state (saved without the optimizer, or weights only); "
                                      "load it without the optimizer in the state to start a fresh one.")
            load_optimizer_dir(self.loaded_path, st.lightning_module, st.engine, self.loaded_meta)
        fabric_names = meta.pop(FABRIC_KEY, None)
        for k in ("state_dict", "optimizer_states", "megatrain_param_groups"):
            meta.pop(k, None)
        if PRECISION_KEY in meta:
            precision.load_state_dict(meta.pop(PRECISION_KEY))
        trainer_schedulers = list(meta.get("lr_schedulers") or []) if fabric_names is None else []
        for key, obj in state.items():
            if roles[key] is not None:
                continue
            if key in meta:
                value = meta.pop(key)
                if isinstance(obj, _Stateful):
                    obj.load_state_dict(value)
                else:
                    state[key] = value
            elif isinstance(obj, LRScheduler) and trainer_schedulers:
                obj.load_state_dict(trainer_schedulers.pop(0))
            elif strict:
                raise KeyError(f"The requested state contains a key '{key}' that does not exist in the loaded "
                               "checkpoint. To disable strict loading, set `strict=False`.")
        if fabric_names is not None:
            meta.pop("lr_schedulers", None)
            meta.pop(VERSION_KEY, None)
        return meta

    def _role(self, obj: Any) -> str | None:
        """``"module"`` (the module the strategy trains), ``"optimizer"`` (its optimizer), or ``None``.

        Raises:
            ValueError: another module or optimizer, which the directory checkpoint would not hold.
        """
        st = self.strategy
        host = st.engine.optimizer if st.engine is not None else None
        if obj is st.lightning_module:
            return "module"
        if host is not None and obj is host.optimizer:
            return "optimizer"
        if isinstance(obj, (nn.Module, Optimizer)):
            raise ValueError(f"megatrain: the checkpoint state holds a {type(obj).__name__} that the strategy does not "
                             "train (the directory checkpoint holds the module set up with it and its optimizer); "
                             "save that object separately (torch.save(obj.state_dict(), path)).")
        return None

    def remove(self, filepath: Any) -> None:
        """Remove a checkpoint directory, file or symlink (not the symlink's target: ``save_last="link"``), as
        ``ModelCheckpoint(save_top_k=...)`` prunes."""
        if self.strategy.is_global_zero:
            remove_entry(Path(filepath))
