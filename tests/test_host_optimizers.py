"""Per-parameter torch optimizers other than AdamW stepped on the host: parity with plain Lightning, exact resume,
torch-format ``state_dict``, refusals.

Every parity test trains the same tiny Llama twice from the same weights with the same optimizer and schedule:
``Trainer(strategy="megatrain")`` and ``Trainer(strategy="auto")`` (plain Lightning on the CPU), 10 steps with
``accumulate_grad_batches=2``, ``gradient_clip_val`` that really clips and a per-step LR schedule, fp32; losses and
final weights must agree bitwise (each class's own for-loop kernel runs on the same numbers in both runs).
"""

from __future__ import annotations

import copy
import importlib.util
import re

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import TensorDataset

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning import MegaTrainPrecision, MegaTrainStrategy, UnsupportedOptimizerError
from megatrain_lightning.checkpoint.lightning_file import convert_to_lightning_checkpoint
from megatrain_lightning.data import ResumableDataLoader
from megatrain_lightning.optim.host_generic import HostTorchOptimizer
from megatrain_lightning.optim.muon import MuonWithAdamW
from megatrain_lightning.testing import LM, make_data, make_model

STEPS = 10
ACCUMULATE = 2
CLIP = 0.5  # below the gradient norm of these models: the clip scales every step


def _two_d(module):
    return [p for p in module.parameters() if p.dim() == 2]


OPTIMIZERS = {
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=2e-3, weight_decay=0.01),
    "nadam": lambda m: torch.optim.NAdam(m.parameters(), lr=2e-3, weight_decay=0.01),
    "radam": lambda m: torch.optim.RAdam(m.parameters(), lr=2e-3),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2, lr_decay=0.01),
    "adafactor": lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2),
    "adamw_amsgrad_maximize": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, amsgrad=True, maximize=True),
    "muon_2d": lambda m: torch.optim.Muon(_two_d(m), lr=2e-2),
    "sgd_two_groups": lambda m: torch.optim.SGD(
        [{"params": _two_d(m), "lr": 0.05, "momentum": 0.9},
         {"params": [p for p in m.parameters() if p.dim() != 2], "lr": 0.01, "weight_decay": 0.0}], lr=0.1),
    # the recipes' optim=muon: Muon for the 2-D weights, AdamW for the rest, one optimizer
    "muon_with_adamw": lambda m: MuonWithAdamW(
        [{"params": _two_d(m), "use_muon": True},
         {"params": [p for p in m.parameters() if p.dim() != 2], "use_muon": False}], lr=2e-2, adamw_lr=1e-3),
}
# the recipes' optim=lion (lion-pytorch is in the test extra)
OPTIMIZERS["lion"] = lambda m: __import__("lion_pytorch").Lion(m.parameters(), lr=1e-4, weight_decay=0.01)
# the recipes' optim=adamw8bit: 8-bit moments (tensor subclasses: uint8 codes, fp32 block scales) on CPU
OPTIMIZERS["adamw8bit"] = lambda m: __import__("torchao.optim", fromlist=["AdamW8bit"]).AdamW8bit(
    m.parameters(), lr=1e-3)


def _model(kind):
    """The tiny Llama; for ``adamw8bit`` one twice as wide with 4 layers, whose weights (4,096-8,192 elements,
    multiples of 256) get 8-bit state (torchao quantises tensors from 4,096 elements; the tiny Llama's are all
    smaller)."""
    if kind == "adamw8bit":
        return make_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    return make_model("llama")


def _equal(a, b):
    """Bitwise equality of two state values; a tensor subclass (torchao's 8-bit state implements no ``equal``)
    compared by its inner tensors (``__tensor_flatten__``)."""
    if hasattr(a, "__tensor_flatten__"):
        names, ctx = a.__tensor_flatten__()
        return type(a) is type(b) and ctx == b.__tensor_flatten__()[1] and all(
            _equal(getattr(a, n), getattr(b, n)) for n in names)
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def _assert_state_kind(kind, state):
    """``adamw8bit``: some parameter's ``exp_avg`` in ``state`` (``state_dict()["state"]``) is an 8-bit subclass."""
    if kind == "adamw8bit":
        assert any(type(st["exp_avg"]).__name__ == "OptimState8bit" for st in state.values())


class OptLM(LM):
    """:class:`LM` with the optimizer ``make_opt(self)`` and a per-step ``StepLR`` (halving every 3 steps)."""

    def __init__(self, model, make_opt):
        super().__init__(model)
        self.make_opt = make_opt

    def configure_optimizers(self):
        opt = self.make_opt(self)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _trainer(strategy, steps=STEPS, **kw):
    kw.setdefault("gradient_clip_val", CLIP)
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, enable_checkpointing=False,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accumulate_grad_batches=ACCUMULATE, **kw)


def _loader():
    """A resumable loader (a resume continues mid-epoch where the save stopped), 2 epochs of batches of 2."""
    ids = next(iter(make_data(n=STEPS * ACCUMULATE * 2, batch_size=STEPS * ACCUMULATE * 2)))[0]
    return ResumableDataLoader(TensorDataset(ids), batch_size=2, shuffle=True, seed=3)


def _fit(model, make_opt, strategy, steps=STEPS, ckpt_path=None, **kw):
    lm = OptLM(copy.deepcopy(model), make_opt)
    torch.manual_seed(0)
    trainer = _trainer(strategy, steps, **kw)
    trainer.fit(lm, _loader(), ckpt_path=ckpt_path)
    return lm, trainer


def _assert_bitwise(lm, ref):
    assert len(lm.losses) == len(ref.losses) == STEPS * ACCUMULATE
    assert lm.losses == ref.losses
    for (name, p), (_, q) in zip(lm.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), name


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_matches_plain_lightning(kind):
    model = _model(kind)
    ref, ref_trainer = _fit(model, OPTIMIZERS[kind], "auto")
    lm, trainer = _fit(model, OPTIMIZERS[kind], "megatrain")
    _assert_bitwise(lm, ref)
    host = trainer.strategy.engine.optimizer
    assert isinstance(host, HostTorchOptimizer)
    # the user's optimizer is the one Lightning and the scheduler saw: same learning rates at the end
    lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
    assert lrs == [g["lr"] for g in ref_trainer.optimizers[0].param_groups]
    # optimizer.state_dict() in torch's format, equal to plain Lightning's
    got, want = trainer.optimizers[0].state_dict(), ref_trainer.optimizers[0].state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    _assert_state_kind(kind, got["state"])
    for i, st in want["state"].items():
        assert sorted(got["state"][i]) == sorted(st), i
        for k, v in st.items():
            assert _equal(got["state"][i][k], v), (i, k)
    # this optimizer keeps its own state: the store's AdamW regions are never allocated
    assert all(s.exp_avg is None and s.exp_avg_sq is None for s in trainer.strategy.engine.store.slabs)


def test_clip_really_clips():
    model = make_model("llama")
    (ids,) = next(iter(_loader()))
    probe = copy.deepcopy(model)
    probe(input_ids=ids, labels=ids).loss.backward()
    assert torch.nn.utils.clip_grad_norm_(probe.parameters(), float("inf")) > 2 * CLIP


@pytest.mark.parametrize("options", [dict(overlap_optimizer=False), dict(optimizer_in_backward=True)])
def test_schedule_options_match_plain_lightning(options):
    make = OPTIMIZERS["sgd_nesterov"]
    model = make_model("llama")
    clip = None if options.get("optimizer_in_backward") else CLIP  # a norm clip needs every gradient first
    ref, _ = _fit(model, make, "auto", gradient_clip_val=clip)
    lm, trainer = _fit(model, make, MegaTrainStrategy(**options), gradient_clip_val=clip)
    _assert_bitwise(lm, ref)
    if options.get("optimizer_in_backward"):
        assert trainer.strategy.engine.optimizer.updates_in_backward > 0


def test_frozen_parameters_and_value_clipping_match_plain_lightning():
    model = make_model("llama")
    frozen = {"model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"}
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    make = lambda m: torch.optim.RMSprop([p for p in m.parameters() if p.requires_grad], lr=1e-3)  # noqa: E731
    ref, _ = _fit(model, make, "auto", gradient_clip_algorithm="value")
    lm, trainer = _fit(model, make, "megatrain", gradient_clip_algorithm="value")
    _assert_bitwise(lm, ref)
    host = trainer.strategy.engine.optimizer
    for slab in trainer.strategy.engine.store.slabs:
        for i, e in enumerate(slab.entries):
            if e.ref.fqn in {"model." + f for f in frozen}:
                assert host.state_for(slab.index, i) is None


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_directory_checkpoint_resume_is_exact(tmp_path, kind):
    """5 steps, a directory checkpoint, 5 more from it = 10 uninterrupted steps, bitwise, for every optimizer."""
    make = OPTIMIZERS[kind]
    model = _model(kind)
    full, _ = _fit(model, make, "megatrain")
    first, t1 = _fit(model, make, "megatrain", steps=5)
    t1.save_checkpoint(tmp_path / "ckpt")
    assert any((tmp_path / "ckpt" / "optimizer").iterdir())
    second, _ = _fit(model, make, "megatrain", ckpt_path=tmp_path / "ckpt")
    assert first.losses + second.losses == full.losses
    for (name, p), (_, q) in zip(second.named_parameters(), full.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), name


@pytest.mark.parametrize("kind", ["rmsprop", "adamw8bit"])
def test_resume_across_strategies_is_exact(tmp_path, kind):
    """A plain Lightning ``.ckpt`` (strategy="auto") resumes under megatrain, and a megatrain directory checkpoint
    converted to a ``.ckpt`` resumes under strategy="auto": both bitwise 10 uninterrupted plain Lightning steps."""
    make = OPTIMIZERS[kind]
    model = _model(kind)
    full, _ = _fit(model, make, "auto")
    plain_first, t1 = _fit(model, make, "auto", steps=5)
    t1.save_checkpoint(tmp_path / "plain.ckpt")
    second, _ = _fit(model, make, "megatrain", ckpt_path=tmp_path / "plain.ckpt")
    assert plain_first.losses + second.losses == full.losses
    for (name, p), (_, q) in zip(second.named_parameters(), full.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), name

    first, t2 = _fit(model, make, "megatrain", steps=5)
    t2.save_checkpoint(tmp_path / "dir")
    convert_to_lightning_checkpoint(tmp_path / "dir", tmp_path / "converted.ckpt")
    want = t1.optimizers[0].state_dict()  # plain Lightning's state after the same 5 steps
    got = torch.load(tmp_path / "converted.ckpt", map_location="cpu")["optimizer_states"][0]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        assert all(_equal(got["state"][i][k], v) for k, v in st.items()), i
    # plain Lightning's Trainer loads a .ckpt with a function as map_location, with which torch cannot rebuild
    # torchao's 8-bit state (its own .ckpt of AdamW8bit does not resume either): megatrain resumes the file
    third, _ = _fit(model, make, "megatrain" if kind == "adamw8bit" else "auto",
                    ckpt_path=tmp_path / "converted.ckpt")
    assert first.losses + third.losses == full.losses
    for (name, p), (_, q) in zip(third.named_parameters(), full.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), name


def test_state_dict_loads_into_plain_torch_and_back():
    make = OPTIMIZERS["adafactor"]
    model = make_model("llama")
    lm, trainer = _fit(model, make, "megatrain", steps=3)
    sd = trainer.optimizers[0].state_dict()
    plain = make(copy.deepcopy(lm))
    plain.load_state_dict(sd)  # torch's own loader accepts it
    assert len(plain.state) == len(sd["state"]) > 0
    host = trainer.strategy.engine.optimizer
    host.load_state_dict(plain.state_dict())
    again = trainer.optimizers[0].state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(again["state"][i][k], v)


class _OverflowLM(OptLM):
    """Micro-batch 6 (step 4) overflows in fp16: that step is skipped and the loss scale halved."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == 6 else loss


def test_fp16_mixed_with_a_skipped_step_matches_plain_lightning():
    make = OPTIMIZERS["nadam"]
    model = make_model("llama")
    runs = []
    for strategy in ("auto", "megatrain"):
        # on CPU Lightning turns precision="16-mixed" into bf16: fp16 plugins built explicitly
        plugin = MegaTrainPrecision("16-mixed") if strategy == "megatrain" else \
            MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        lm = _OverflowLM(copy.deepcopy(model), make)
        torch.manual_seed(0)
        _trainer(strategy, plugins=[plugin]).fit(lm, _loader())
        runs.append((lm, plugin))
    (ref, _), (lm, plugin) = runs
    assert plugin.skipped_steps == 1
    assert lm.losses == ref.losses
    for (name, p), (_, q) in zip(lm.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), name


class _SwitchToSGD(pl.Callback):
    """At the 6th step (micro-batch 10), a new optimizer of another class, as a callback changing optimizers does."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 10:
            pl_module.make_opt = OPTIMIZERS["sgd_nesterov"]
            trainer.strategy.setup_optimizers(trainer)


class _ClearState(pl.Callback):
    """At the 6th step, ``optimizer.state.clear()``: the next update starts the class's state afresh."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 10:
            trainer.optimizers[0].state.clear()


@pytest.mark.parametrize("first, callback", [("adamw", _SwitchToSGD), ("rmsprop", _ClearState)])
def test_mid_fit_changes_match_plain_lightning(first, callback):
    make = OPTIMIZERS[first] if first != "adamw" else (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    model = make_model("llama")
    ref, _ = _fit(model, make, "auto", callbacks=[callback()])
    lm, trainer = _fit(model, make, "megatrain", callbacks=[callback()])
    _assert_bitwise(lm, ref)
    assert isinstance(trainer.strategy.engine.optimizer, HostTorchOptimizer)


# ---------------------------------------------------------------------------------------------------- refusals
class _LBFGSLM(LM):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


class _SparseAdamLM(LM):
    def configure_optimizers(self):
        return torch.optim.SparseAdam(self.parameters())


class _FlagLM(LM):
    flag = ""

    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), **{self.flag: True})


def _setup_only(lm, strategy="megatrain"):
    pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=1, enable_checkpointing=False, logger=False,
               enable_progress_bar=False, enable_model_summary=False).fit(lm, make_data(n=2))


def test_lbfgs_is_refused():
    with pytest.raises(UnsupportedOptimizerError, match=r"torch\.optim\.lbfgs\.LBFGS.*closure"):
        _setup_only(_LBFGSLM(make_model("llama")))


def test_sparse_adam_is_refused():
    with pytest.raises(UnsupportedOptimizerError, match=r"SparseAdam.*sparse"):
        _setup_only(_SparseAdamLM(make_model("llama")))


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_capturable_and_differentiable_are_refused(flag):
    lm = _FlagLM(make_model("llama"))
    lm.flag = flag
    with pytest.raises(UnsupportedOptimizerError, match=f"RMSprop.*{flag}=True"):
        _setup_only(lm)


def _nvme(tmp_path, params="cpu", host_memory_limit=1_500_000):
    return MegaTrainStrategy(offload_params=params, offload_optimizer="nvme", nvme_path=str(tmp_path),
                             host_memory_limit=host_memory_limit)


ON_NVME = {  # three state tensors per parameter do not fit the two regions (refused below): the variants that fit
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, centered=True),
    "adamw_amsgrad_maximize": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, maximize=True),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_optimizer_state_on_nvme_matches_plain_lightning(tmp_path, kind):
    """The state on disk (packed into each parameter's exp_avg/exp_avg_sq ranges), read through a host window
    smaller than the model (the masters on disk too for every other kind): bitwise plain Lightning, and
    ``state_dict()`` equal to plain Lightning's."""
    make = ON_NVME.get(kind, OPTIMIZERS[kind])
    params = "nvme" if sorted(OPTIMIZERS).index(kind) % 2 else "cpu"  # masters on disk too for every other kind
    model = _model(kind)
    ref, ref_trainer = _fit(model, make, "auto")
    limit = 1_700_000 if kind == "adamw8bit" else 1_500_000  # the wider adamw8bit model's blocks need more
    lm, trainer = _fit(model, make, _nvme(tmp_path, params, limit))
    _assert_bitwise(lm, ref)
    host = trainer.strategy.engine.optimizer
    assert isinstance(host, HostTorchOptimizer) and host.on_disk and host.packed
    assert all(s.exp_avg is None for s in trainer.strategy.engine.store.slabs)  # never in RAM
    got, want = trainer.optimizers[0].state_dict(), ref_trainer.optimizers[0].state_dict()
    assert sorted(got["state"]) == sorted(want["state"])
    _assert_state_kind(kind, got["state"])
    for i, st in want["state"].items():
        assert list(got["state"][i]) == list(st), i  # the class's own key order
        for k, v in st.items():
            assert _equal(got["state"][i][k], v), (i, k)


def test_the_nvme_update_moves_only_the_state_regions_the_class_uses(tmp_path):
    """SGD without momentum keeps no tensor state and SGD with momentum one buffer per element: after each slab's
    first update (which decides the placements) their updates hold no optimizer region, and ``exp_avg`` only, so
    the NVMe tier reads and writes less per step than with both regions; numbers bitwise plain Lightning."""
    model = make_model("llama")
    stateless = lambda m: torch.optim.SGD(m.parameters(), lr=0.05)  # noqa: E731
    momentum = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    moved, kinds = {}, {}
    for name, make in (("stateless", stateless), ("momentum", momentum)):
        ref, _ = _fit(model, make, "auto")
        (tmp_path / name).mkdir()
        lm, trainer = _fit(model, make, _nvme(tmp_path / name))
        _assert_bitwise(lm, ref)
        eng = trainer.strategy.engine
        io = eng.store.nvme.meter.snapshot()
        moved[name] = io["nvme_read_bytes"] + io["nvme_write_bytes"]
        kinds[name] = {tuple(eng.optimizer._state_kinds(s)) for s in eng.store.slabs if s.trainable_numel}
    assert kinds == {"stateless": {()}, "momentum": {("exp_avg",)}}
    assert moved["stateless"] < moved["momentum"], moved


@pytest.mark.parametrize("kind", ["adafactor", "adamw8bit"])
def test_directory_checkpoint_resume_on_nvme_is_exact(tmp_path, kind):
    """5 steps, a directory checkpoint, 5 more from it (both with the state on NVMe) = 10 uninterrupted steps in RAM."""
    make = OPTIMIZERS[kind]
    model = _model(kind)
    limit = 1_700_000 if kind == "adamw8bit" else 1_500_000
    full, _ = _fit(model, make, "megatrain")
    first, t1 = _fit(model, make, _nvme(tmp_path, host_memory_limit=limit), steps=5)
    t1.save_checkpoint(tmp_path / "ckpt")
    t1.strategy.close()
    second, _ = _fit(model, make, _nvme(tmp_path, host_memory_limit=limit), ckpt_path=tmp_path / "ckpt")
    assert first.losses + second.losses == full.losses
    for (name, p), (_, q) in zip(second.named_parameters(), full.named_parameters()):
        assert torch.equal(p.detach(), q.detach()), name


@pytest.mark.parametrize("make,why", [
    (lambda m: torch.optim.RMSprop(m.parameters(), momentum=0.5, centered=True), r"RMSprop.*square_avg.*momentum_buffer"),
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), r"AdamW.*max_exp_avg_sq"),
])
def test_state_larger_than_two_floats_per_element_is_refused_on_nvme(tmp_path, make, why):
    lm = OptLM(make_model("llama"), make)
    with pytest.raises(UnsupportedOptimizerError, match=why + r".*offload_optimizer='cpu'") as err:
        _setup_only(lm, _nvme(tmp_path))
    # the message names a shape the model has (not the small stand-in the check steps) and the bytes per element
    shape = re.search(r"of shape (\([0-9, ]*\))", str(err.value)).group(1)
    assert shape in {str(tuple(q.shape)) for q in lm.parameters()}, shape
    assert "keeps 12 bytes of tensors per element" in str(err.value)


def test_pack_fits_two_ranges_or_says_no():
    from torchao.optim.subclass_8bit import OptimState8bit

    from megatrain_lightning.optim.state_packing import pack, rebuild, unpackable

    z = torch.zeros
    got = pack({"exp_avg": z(4, 3), "exp_avg_sq": z(4, 3)}, 12).placements
    assert [(p.key, p.region, p.offset) for p in got] == [("exp_avg", 0, 0), ("exp_avg_sq", 1, 0)]
    got = pack({"row_var": z(4, 1), "col_var": z(1, 3)}, 12).placements  # Adafactor's factors share the first range
    assert [(p.region, p.offset) for p in got] == [(0, 0), (0, 16)]  # offsets in bytes
    assert pack({"a": z(8), "b": z(8), "c": z(8)}, 12) is None  # 24 values fit, but not without a split
    assert "more than the two fp32 values" in unpackable({"a": z(12), "b": z(12), "c": z(1)}, 12)
    assert "wider than 4 bytes" in unpackable({"q": z(12, dtype=torch.float64)}, 12)
    assert unpackable({"step": torch.tensor(3.0), "m": z(12)}, 12) is None  # 0-d values stay in RAM
    # 1-byte codes after a 4-byte tensor, and bf16 after 1-byte codes: each at an offset aligned to its size
    got = pack({"s": z(3), "c": z(5, dtype=torch.uint8), "h": z(2, dtype=torch.bfloat16)}, 4).placements
    assert [(p.key, p.region, p.offset) for p in got] == [("s", 0, 0), ("c", 1, 0), ("h", 0, 12)]
    # torchao's 8-bit moments: codes, block scales and qmap of both packed in the first range (2.03 bytes/element)
    m, v = (OptimState8bit.zeros((64, 128), signed=s, block_size=256) for s in (True, False))
    m.copy_(torch.randn(64, 128))
    layout = pack({"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": v}, 64 * 128)
    assert layout.regions == {0} and sorted(layout.wrappers) == ["exp_avg", "exp_avg_sq"]
    regions = (torch.zeros(64 * 128), torch.zeros(64 * 128))
    for pl in layout.placements:
        pl.view(regions, 0).copy_({"exp_avg": m, "exp_avg_sq": v}[pl.key.split(".")[0]].__getattribute__(
            pl.key.split(".")[1]))
    back = rebuild(layout, lambda pl: pl.view(regions, 0))
    assert list(back) == ["exp_avg", "exp_avg_sq"] and type(back["exp_avg"]) is OptimState8bit
    assert torch.equal(back["exp_avg"].dequantize(), m.dequantize())
    assert back["exp_avg"].codes.data_ptr() == regions[0].data_ptr()  # a view: the class's writes land in the range


def test_masters_on_nvme_with_the_optimizer_in_ram_match_plain_lightning(tmp_path):
    make = OPTIMIZERS["adafactor"]
    model = make_model("llama")
    ref, _ = _fit(model, make, "auto")
    lm, trainer = _fit(model, make, MegaTrainStrategy(offload_params="nvme", offload_optimizer="cpu",
                                                      nvme_path=str(tmp_path), host_memory_limit=600_000))
    assert trainer.strategy.engine.store.masters_on_disk
    _assert_bitwise(lm, ref)


def _sgd_fit_from(ckpt, strategy):
    pl.seed_everything(0, verbose=False)
    lm = LM(make_model("llama"), lr=1e-2, optimizer=torch.optim.SGD, opt_kwargs={"momentum": 0.9})
    _trainer(strategy, steps=4).fit(lm, make_data(32), ckpt_path=ckpt)


def test_resuming_adamw_state_with_sgd_is_refused(tmp_path):
    """AdamW's checkpoint resumed by a module whose configure_optimizers returns SGD: plain Lightning stops (torch's
    SGD step finds no ``momentum`` in the loaded group); so does megatrain, before any step, from its directory
    checkpoint and from a plain ``.ckpt`` file, naming the hyper-parameters the saved groups lack."""
    pl.seed_everything(0, verbose=False)
    t = _trainer(MegaTrainStrategy(), steps=2)
    t.fit(LM(make_model("llama"), lr=1e-2), make_data(32))
    t.save_checkpoint(tmp_path / "dir")
    t.strategy.close()
    pl.seed_everything(0, verbose=False)
    plain = _trainer("auto", steps=2)
    plain.fit(LM(make_model("llama"), lr=1e-2), make_data(32))
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(KeyError, match="momentum"):
        _sgd_fit_from(tmp_path / "plain.ckpt", "auto")
    for ckpt in (tmp_path / "dir", tmp_path / "plain.ckpt"):
        match = "the saved param groups lack dampening, momentum, hyper-parameters of SGD"
        with pytest.raises(ValueError, match=match):
            _sgd_fit_from(ckpt, MegaTrainStrategy())


def test_other_parameters_under_strict_loading_false_say_what_to_do(tmp_path):
    """A checkpoint of a 3-layer model resumed by a 4-layer one with ``strict_loading = False``: fit cannot resume the
    optimizer state (plain Lightning stops too); the error says how to start from the weights instead."""
    pl.seed_everything(0, verbose=False)
    t = _trainer(MegaTrainStrategy(), steps=2)
    t.fit(LM(make_model("llama")), make_data(32))
    t.save_checkpoint(tmp_path / "dir")
    t.strategy.close()
    lm = LM(make_model("llama", num_hidden_layers=4))
    lm.strict_loading = False
    with pytest.raises(ValueError, match="its optimizer state cannot be resumed .* then fit without ckpt_path"):
        _trainer(MegaTrainStrategy(), steps=4).fit(lm, make_data(32), ckpt_path=tmp_path / "dir")
