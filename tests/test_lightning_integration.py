"""What a Lightning user expects from strategy="megatrain" besides exact training."""

from __future__ import annotations

import copy
import logging

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import grad_norm
from torch import nn

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainStrategy, discover_blocks
from megatrain_lightning.testing import LM, SEQ, VOCAB, BackboneLM, assert_parity, make_data, make_model, reference_train, rel


def _trainer(tmp_path=None, **kw):
    base = dict(strategy="megatrain", accelerator="cpu", max_steps=6, enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False)
    base.update(kw)
    return pl.Trainer(**base)


def test_string_and_instance_forms_resolve():
    t = _trainer()
    assert isinstance(t.strategy, MegaTrainStrategy)
    assert t.strategy.root_device == torch.device("cpu")
    s = MegaTrainStrategy(lookahead=2)
    t = _trainer(strategy=s)
    assert t.strategy is s and s.lookahead == 2


def test_validate_test_predict_stream_and_match_plain_eval():
    model = make_model("llama")
    ref = copy.deepcopy(model).eval()
    lm = LM(model)
    data = make_data(n=8)
    trainer = _trainer()
    (out,) = trainer.validate(lm, data)
    with torch.no_grad():
        ref_loss = sum(ref(input_ids=b[0], labels=b[0]).loss for b in data) / len(data)
    assert abs(out["val_loss"] - ref_loss.item()) / ref_loss.item() < 1e-5
    assert trainer.strategy.engine.stats.blocks_fetched > 0  # it streamed
    # the module is a plain module again after teardown: forward restored, weights are store views
    assert "forward" not in lm.model.model.layers[0].__dict__
    trainer.test(lm.__class__.__dict__.get("test_step") and lm or _with_test_step(lm), data)
    preds = _trainer().predict(_with_predict(lm), data)
    with torch.no_grad():
        ref_logits = ref(input_ids=next(iter(data))[0]).logits
    assert rel(preds[0], ref_logits) < 1e-5


def _with_test_step(lm):
    lm.test_step = lm.validation_step
    return lm


def _with_predict(lm):
    lm.predict_step = lambda batch, batch_idx: lm.model(input_ids=batch[0]).logits
    return lm


def test_validation_inside_fit_sees_updated_weights():
    """Validation after step k must use the weights after k updates (pending updates applied)."""
    model = make_model("llama")
    ref = copy.deepcopy(model)
    seen = []

    class ValLM(LM):
        def validation_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            seen.append(loss.item())
            self.log("val_loss", loss)

    lm = ValLM(model)
    trainer = _trainer(max_steps=4, val_check_interval=2, num_sanity_val_steps=0, limit_val_batches=1)
    trainer.fit(lm, make_data(n=8), make_data(n=2, seed=9))
    ref.train()
    reference_train(ref, make_data(n=8), 2)
    with torch.no_grad():
        ids = next(iter(make_data(n=2, seed=9)))[0]
        ref.eval()
        expect = ref(input_ids=ids, labels=ids).loss.item()
    assert abs(seen[0] - expect) / expect < 1e-5


def test_grad_views_lr_monitor_and_stats_logged(tmp_path):
    model = make_model("llama")
    norms = []

    class HookLM(LM):
        def on_before_optimizer_step(self, optimizer):
            for p in self.parameters():
                if p.grad is not None:
                    assert p.grad.dtype == torch.float32 and p.grad.device.type == "cpu"
            norms.append(grad_norm(self, norm_type=2)["grad_2.0_norm_total"])

    lm = HookLM(model, sched="cosine", total_steps=6)
    logger = CSVLogger(tmp_path, name="run")
    trainer = _trainer(logger=logger, log_every_n_steps=1, callbacks=[LearningRateMonitor("step")])
    trainer.fit(lm, make_data(n=12))
    assert len(norms) == 6 and all(n > 0 for n in norms)
    metrics = (tmp_path / "run" / "version_0" / "metrics.csv").read_text()
    for key in ("megatrain/h2d_bytes", "megatrain/d2h_bytes", "megatrain/wait_s", "megatrain/optimizer_s",
                "megatrain/peak_device_bytes", "lr-AdamW"):
        assert key in metrics, key
    hist = trainer.strategy.engine.history
    n_params = sum(p.numel() for p in lm.parameters())
    # a 32-true CPU run binds the fp32 masters (cpu_zero_copy, the default): nothing is copied host -> device
    # (the copies' bytes are checked against the planner in tests/test_plan_recompute.py); every trainable
    # parameter's fp32 gradient crosses D2H once, the embedding's as the rows its tokens read
    # (engine/row_grads.py): one fp32 row of 32 and an int64 row id per token, 2 x 16 tokens per step
    emb = lm.model.model.embed_tokens.weight.numel()
    assert all(h["megatrain/h2d_bytes"] == 0 for h in hist) and all(h["megatrain/blocks_fetched"] > 0 for h in hist)
    assert all(h["megatrain/d2h_bytes"] == 4 * (n_params - emb) + 2 * 16 * (32 * 4 + 8) for h in hist)


def test_state_dict_is_store_views_and_save_pretrained(tmp_path):
    model = make_model("llama_tied")
    lm = LM(model)
    trainer = _trainer()
    trainer.fit(lm, make_data(n=12))
    sd = trainer.strategy.lightning_module_state_dict()
    store = trainer.strategy.engine.store
    bases = {s.master.untyped_storage().data_ptr() for s in store.slabs}
    for k, v in sd.items():
        if v.is_floating_point() and "rotary" not in k and "inv_freq" not in k:
            assert v.untyped_storage().data_ptr() in bases, k
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight  # tie kept
    lm.model.save_pretrained(tmp_path / "hf")
    import transformers
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for (k, a), (_, b) in zip(sorted(back.state_dict().items()), sorted(lm.model.state_dict().items())):
        assert torch.equal(a, b), k


def test_the_optimizers_state_dict_is_plain_lightnings():
    """``trainer.optimizers[0].state_dict()`` after fit is the AdamW state plain Lightning's optimizer holds (the
    torch optimizer holds none here: it returned an empty state without a word), bitwise; ``load_state_dict`` puts
    a state back into the host store."""
    model = make_model("llama")
    plain, ours = LM(copy.deepcopy(model)), LM(copy.deepcopy(model))
    kw = dict(accelerator="cpu", max_steps=4, enable_checkpointing=False, logger=False, enable_progress_bar=False,
              enable_model_summary=False)
    tp = pl.Trainer(strategy="auto", **kw)
    tp.fit(plain, make_data())
    to = pl.Trainer(strategy="megatrain", **kw)
    to.fit(ours, make_data())
    want, got = tp.optimizers[0].state_dict(), to.optimizers[0].state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) and len(got["state"]) == len(list(model.parameters()))
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    zero = {"state": {i: {k: torch.zeros_like(v) for k, v in st.items()} for i, st in want["state"].items()},
            "param_groups": want["param_groups"]}
    to.optimizers[0].load_state_dict(zero)
    assert all(v.abs().sum() == 0 for st in to.optimizers[0].state_dict()["state"].values() for v in st.values())
    to.optimizers[0].load_state_dict(want)
    assert all(torch.equal(to.optimizers[0].state_dict()["state"][i]["exp_avg"], st["exp_avg"])
               for i, st in want["state"].items())


def test_kv_cache_in_config_does_not_corrupt_gradients():
    """use_cache=True (the default of most configs) must not leak into the recompute."""
    model = make_model("llama", use_cache=True)
    ref = copy.deepcopy(model)
    ref.config.use_cache = False

    class CacheLM(LM):
        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids, use_cache=True).loss
            self.losses.append(loss.item())
            return loss

    lm = CacheLM(model)
    _trainer(max_steps=10).fit(lm, make_data(n=20))
    ref_losses = reference_train(ref, make_data(n=20), 10)
    assert_parity(lm.model, ref, lm.losses, ref_losses)


def test_hf_gradient_checkpointing_is_off_during_the_run_and_back_on_after(caplog):
    """HF checkpointing is off while the strategy runs (its ``recompute`` decides), with a warning, and back on as
    the user set it after fit (else a later plain training of the model would lose its memory saving)."""
    model = make_model("llama")
    ref = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    flags = [(n, m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None))
             for n, m in model.named_modules() if hasattr(m, "gradient_checkpointing")]
    lm = LM(model)
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning"):
        _trainer(max_steps=5).fit(lm, make_data(n=10))
    assert any("gradient checkpointing enabled; it is off during the run" in r.getMessage() for r in caplog.records)
    ref_losses = reference_train(ref, make_data(n=10), 5)
    assert_parity(lm.model, ref, lm.losses, ref_losses)
    assert model.is_gradient_checkpointing
    assert flags == [(n, m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None))
                     for n, m in model.named_modules() if hasattr(m, "gradient_checkpointing")]


def test_a_from_pretrained_model_with_hub_kernels_trains_with_validation_like_plain(tmp_path):
    """transformers 5 turns hub kernels on for ``from_pretrained`` models when ``kernels`` is installed, and each
    ``train()``/``eval()`` switch re-runs ``kernelize``, which pops instance ``forward``s -- the blocks' streaming
    proxies among them. Kernels are off during the run (training and validation match plain PyTorch) and back on
    after it."""
    pytest.importorskip("kernels")
    import transformers

    make_model("llama").save_pretrained(tmp_path / "m")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", use_kernels=False)
    assert model.use_kernels, "from_pretrained no longer turns hub kernels on: this test checks nothing"
    model.train()  # from_pretrained returns it in eval mode; validation's eval() then changes the kernels' mode
    lm = LM(model)
    _trainer(max_steps=4, val_check_interval=2, limit_val_batches=1).fit(lm, make_data(n=8), make_data(n=2))
    assert_parity(lm.model, ref, lm.losses, reference_train(ref, make_data(n=8), 4))
    assert model.use_kernels and "forward" not in model.model.norm.__dict__


def test_lightning_ckpt_roundtrip_resumes_like_plain_lightning(tmp_path):
    """A directory checkpoint round-trips the host weights and AdamW state. Reference: the same
    save/resume with plain Lightning (strategy="auto") and its .ckpt file."""
    model = make_model("llama")

    def save_then_resume(strategy):
        first = LM(copy.deepcopy(model))
        t1 = _trainer(strategy=strategy, max_steps=4)
        t1.fit(first, make_data(n=8))
        ckpt = tmp_path / f"{strategy}.ckpt"
        t1.save_checkpoint(ckpt)
        second = LM(copy.deepcopy(model))
        _trainer(strategy=strategy, max_steps=8).fit(second, make_data(n=8), ckpt_path=ckpt)
        return first.losses + second.losses, second

    ours, lm = save_then_resume("megatrain")
    ref, ref_lm = save_then_resume("auto")
    assert len(ours) == 8
    assert_parity(lm.model, ref_lm.model, ours, ref)


def test_callback_sees_updated_weights_after_flush():
    model = make_model("llama")
    snap = []

    class Snap(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.strategy.flush()
            snap.append(pl_module.model.model.norm.weight.detach().clone())

    lm = LM(model)
    _trainer(max_steps=2, callbacks=[Snap()]).fit(lm, make_data(n=4))
    assert torch.equal(snap[-1], lm.model.model.norm.weight.detach())
    assert not torch.equal(snap[0], snap[1])


def test_training_step_reading_weights_sees_what_plain_lightning_sees_after_flush_or_without_overlap():
    """A ``training_step`` that reads the weights before the forward (a logged weight norm) sees the previous
    step's update only after ``trainer.strategy.flush()`` or with ``overlap_optimizer=False`` (README: the update
    is otherwise applied during the forward); then every value equals plain Lightning's."""

    class Reads(LM):
        def __init__(self, model, flush):
            super().__init__(model)
            self.flush, self.seen = flush, []

        def training_step(self, batch, batch_idx):
            if self.flush:
                self.trainer.strategy.flush()
            self.seen.append([p.detach().clone() for p in self.parameters()])
            return super().training_step(batch, batch_idx)

    def seen(strategy, flush=False):
        lm = Reads(make_model("llama"), flush)
        _trainer(strategy=strategy, max_steps=3).fit(lm, make_data(n=8))
        return lm.seen

    ref = seen("auto")
    stale = seen("megatrain")
    assert all(map(torch.equal, stale[1], ref[0])) and not all(map(torch.equal, stale[1], ref[1]))  # documented
    for ours in (seen("megatrain", flush=True), seen(MegaTrainStrategy(overlap_optimizer=False))):
        assert all(all(map(torch.equal, a, b)) for a, b in zip(ours, ref, strict=True))


def test_default_trainer_callbacks_progress_bar_and_self_log(tmp_path):
    """Plain Trainer defaults: progress bar, model summary, ModelCheckpoint, logger, self.log."""
    model = make_model("gemma2")

    class LogLM(LM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, prog_bar=True)
            return loss

    lm = LogLM(model)
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", max_epochs=2, default_root_dir=tmp_path,
                         log_every_n_steps=1)
    trainer.fit(lm, make_data(n=8), make_data(n=4, seed=3))
    assert trainer.callback_metrics["train_loss"] > 0 and "val_loss" in trainer.callback_metrics
    ckpts = [p for p in tmp_path.rglob("*.ckpt") if p.is_dir()]
    assert ckpts, "ModelCheckpoint wrote no checkpoint directory"
    state = torch.load(ckpts[0] / "trainer.pt", weights_only=True)
    assert "loops" in state and "callbacks" in state
    from megatrain_lightning.checkpoint.hf_io import SafetensorsSource
    n_states = sum(1 for k in SafetensorsSource(ckpts[0] / "optimizer").keys() if k.endswith("/exp_avg"))
    assert n_states == sum(p.requires_grad for p in lm.parameters())


def test_resuming_a_weights_only_checkpoint_is_refused_like_plain_lightning(tmp_path):
    """``ModelCheckpoint(save_weights_only=True)`` writes no AdamW state: ``fit(ckpt_path=...)`` from it raises
    Lightning's own KeyError naming the optimizer state (it named the LR scheduler: the directory's metadata
    listed an empty ``optimizer_states``), and ``validate(ckpt_path=...)`` loads its weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    messages = {}
    for strategy in ("auto", "megatrain"):
        cb = ModelCheckpoint(dirpath=tmp_path / strategy, save_weights_only=True, every_n_train_steps=2)
        trained = LM(make_model("llama"))
        _trainer(tmp_path, strategy=strategy, max_steps=2, callbacks=[cb], enable_checkpointing=True).fit(trained, make_data(n=8))
        with pytest.raises(KeyError) as err:
            _trainer(tmp_path, strategy=strategy, max_steps=4).fit(LM(make_model("llama", seed=1)), make_data(n=8),
                                                                    ckpt_path=cb.best_model_path)
        messages[strategy] = str(err.value)
        fresh = LM(make_model("llama", seed=1))
        _trainer(tmp_path, strategy=strategy).validate(fresh, make_data(n=4), ckpt_path=cb.best_model_path)
        assert torch.equal(fresh.model.lm_head.weight, trained.model.lm_head.weight)
    assert messages["megatrain"] == messages["auto"] and "optimizer state" in messages["auto"]


# ---------------------------------------------------------------- containers that own parameters
class _Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, h):
        return h + self.fc2(torch.tanh(self.fc1(h)))


class _Net(nn.Module):
    """A container that owns parameters (``pos``, ``scale``, frozen ``shift``) used directly in its
    forward, between and around the layers it holds."""

    def __init__(self, d=16, n=3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.1)
        self.layers = nn.ModuleList([_Layer(d) for _ in range(n)])
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(d))
        self.shift = nn.Parameter(0.1 * torch.randn(d), requires_grad=False)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            h = layer(h) * self.scale
        return self.head(h + self.shift)


class ContainerLM(pl.LightningModule):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = _Net()
        self.losses: list[float] = []

    def _loss(self, ids):
        logits = self.net(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch[0])
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch[0]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def test_container_parameters_form_their_own_block():
    blocks = discover_blocks(ContainerLM(), block_names=["net.layers.*"])
    assert [(b.name, b.direct) for b in blocks] == [
        ("net", True), ("net.emb", False), ("net.layers.0", False), ("net.layers.1", False),
        ("net.layers.2", False), ("net.head", False)]
    # the container's block holds only its direct parameters, not its children's
    assert [r.fqn for r in blocks[0].params] == ["net.pos", "net.scale", "net.shift"]
    assert [r.fqn for r in blocks[2].params] == ["net.layers.0.fc1.weight", "net.layers.0.fc1.bias",
                                                 "net.layers.0.fc2.weight", "net.layers.0.fc2.bias"]
    # without a block below it the same module still swallows its children (one block, as before)
    assert [b.name for b in discover_blocks(ContainerLM(), block_names=["net"])] == ["net"]


@pytest.mark.parametrize("options,trainer_kw", [
    ({}, {}),
    ({"optimizer_in_backward": True, "cpu_zero_copy": False}, {}),
    ({"recompute_every": 2, "offload_activations": True}, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}),
    ({"offload_params": "nvme", "offload_optimizer": "nvme", "host_memory_limit": 400_000}, {}),
], ids=["default", "optimizer_in_backward", "accumulate_clip_K2", "nvme"])
def test_container_parameters_train_like_plain_lightning(tmp_path, options, trainer_kw):
    """A container's own parameters are used in its forward outside any block call; they must get
    the gradients and updates plain Lightning gives them (losses and weights within 1e-6)."""
    if "nvme_path" not in options and options.get("offload_params") == "nvme":
        options = {**options, "nvme_path": str(tmp_path)}
    lm, ref = ContainerLM(), ContainerLM()
    data, val = make_data(n=16), make_data(n=4, seed=7)
    trainer = _trainer(strategy=MegaTrainStrategy(block_names=["net.layers.*"], **options), max_steps=5, **trainer_kw)
    trainer.fit(lm, data)
    plain = _trainer(strategy="auto", max_steps=5, **trainer_kw)
    plain.fit(ref, data)
    assert_parity(lm, ref, lm.losses, ref.losses, tol=1e-6)
    assert not torch.equal(lm.net.pos.detach(), ContainerLM().net.pos.detach())  # it trained
    eng = trainer.strategy.engine
    assert not eng.boundary.kept_open and eng.acct.live == 0  # the container's buffer and gradient bytes came back
    # evaluation (no_grad) binds the container's parameters too
    (ours,) = trainer.validate(lm, val)
    (theirs,) = plain.validate(ref, val)
    assert abs(ours["val_loss"] - theirs["val_loss"]) <= 1e-6 * theirs["val_loss"]


def test_parameter_used_outside_its_module_is_an_error():
    """Reading a container's parameter outside the container's forward (here in training_step) gives
    it a plain autograd gradient the engine never sees: an error naming it, not a silent no-update."""

    class Outside(ContainerLM):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch, batch_idx) + self.net.scale.square().sum()

    with pytest.raises(RuntimeError, match=r"\['net.scale'\].*outside"):
        _trainer(strategy=MegaTrainStrategy(block_names=["net.layers.*"]), max_steps=1).fit(Outside(), make_data(n=4))


class _TorchLayersLM(ContainerLM):
    """A decoder built from ``nn.TransformerEncoderLayer`` (its ``nn.MultiheadAttention`` projects a transposed,
    non-contiguous input) with a causal mask; ContainerLM's steps and optimizer."""

    def __init__(self, d=32):
        pl.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True,
                                                                norm_first=True) for _ in range(2)])
        self.head = nn.Linear(d, VOCAB)
        self.losses: list[float] = []

    def _loss(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h, mask, None, True)  # src, src_mask, src_key_padding_mask, is_causal
        return F.cross_entropy(self.head(h)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def test_torch_nn_transformer_layers_train_bitwise_like_plain_lightning():
    """``block_classes=[nn.TransformerEncoderLayer]``: losses, weights and the validation loss bitwise plain
    Lightning's. They were 5e-7 off: ``F.linear`` on a non-contiguous 3-D input picks its kernel by the weight's
    ``requires_grad``, and without a graph (the training forward, evaluation) the weights were bound without it."""
    ours, ref = _TorchLayersLM(), _TorchLayersLM()
    kw = dict(max_steps=4, accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer = _trainer(strategy=MegaTrainStrategy(block_classes=[nn.TransformerEncoderLayer]), **kw)
    trainer.fit(ours, make_data(n=16))
    plain = _trainer(strategy="auto", **kw)
    plain.fit(ref, make_data(n=16))
    assert ours.losses == ref.losses
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))
    assert trainer.validate(ours, make_data(n=4, seed=3)) == plain.validate(ref, make_data(n=4, seed=3))  # no grad


def test_reentrant_checkpoint_inside_a_block_is_named():
    """A block whose forward runs ``torch.utils.checkpoint(..., use_reentrant=True)`` cannot be differentiated by the
    engine's per-block ``torch.autograd.grad``: an error saying so and what to use, instead of torch's message about
    ``.grad()`` (which the user never called). ``use_reentrant=False`` trains bitwise like plain Lightning."""

    class Checkpointed(nn.Module):
        def __init__(self, layer, reentrant):
            super().__init__()
            self.layer, self.reentrant = layer, reentrant

        def forward(self, h, mask, _pad, is_causal):
            return torch.utils.checkpoint.checkpoint(self.layer, h, mask, None, is_causal, use_reentrant=self.reentrant)

    def lm(reentrant):
        m = _TorchLayersLM()
        m.layers = nn.ModuleList([Checkpointed(layer, reentrant) for layer in m.layers])
        return m

    strategy = lambda: MegaTrainStrategy(block_classes=[Checkpointed])  # noqa: E731
    with pytest.raises(RuntimeError, match=r"use_reentrant=True.*Pass use_reentrant=False"):
        _trainer(strategy=strategy(), max_steps=1).fit(lm(True), make_data(n=4))
    ours, ref = lm(False), lm(False)
    _trainer(strategy=strategy(), max_steps=3).fit(ours, make_data(n=8))
    _trainer(strategy="auto", max_steps=3).fit(ref, make_data(n=8))
    assert ours.losses == ref.losses
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))


# ---------------------------------------------------------------- engine statistics through Lightning
class _Recorder(Logger):
    """A logger that keeps every ``log_metrics`` call: ``rows = [(step, metrics)]``."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def steps_of(self, key):
        return [s for s, m in self.rows if key in m]


class _UserLogLM(LM):
    """Logs its own step metric the way a Lightning user does; the reference for steps."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("user_loss", loss, on_step=True, on_epoch=False)
        return loss


class _ManualLM(_UserLogLM):
    def __init__(self, model):
        super().__init__(model)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()


@pytest.mark.parametrize("every,steps,accumulate,manual", [
    (1, 4, 1, False), (2, 6, 1, False), (2, 5, 1, False), (2, 6, 2, False), (3, 7, 1, True),
])
def test_stats_reach_every_logger_at_lightnings_steps(tmp_path, every, steps, accumulate, manual):
    """megatrain/* go through Lightning's logging: every logger gets them, at exactly the steps at which
    plain Lightning logs a user's ``self.log(..., on_step=True)`` metric (log_every_n_steps honoured),
    each value is the one of the optimizer step it is logged for, and callback_metrics holds them."""
    csv, rec = CSVLogger(tmp_path, name="csv"), _Recorder()
    lm = (_ManualLM if manual else _UserLogLM)(make_model("llama"))
    trainer = _trainer(logger=[csv, rec], log_every_n_steps=every, max_steps=steps, accumulate_grad_batches=accumulate)
    trainer.fit(lm, make_data(n=32))

    plain_rec = _Recorder()
    plain_lm = (_ManualLM if manual else _UserLogLM)(make_model("llama"))
    _trainer(strategy="auto", logger=[plain_rec], log_every_n_steps=every, max_steps=steps,
             accumulate_grad_batches=accumulate).fit(plain_lm, make_data(n=32))
    expect = plain_rec.steps_of("user_loss")
    assert expect == [s for s in range(steps) if (s + 1) % every == 0]  # what Lightning does
    hist = trainer.strategy.engine.history
    assert len(hist) == steps  # one accounting window per optimizer step
    keys = sorted(hist[0])
    for key in keys:
        assert rec.steps_of(key) == expect, key  # once per logged step, at the user metric's steps
    for step, row in rec.rows:
        if "megatrain/h2d_bytes" in row:
            # logged at step s: the window of optimizer step s + 1 (Lightning's step numbering)
            assert {k: row[k] for k in keys} == hist[step]
    # the CSV logger got the same values (one row per logged step)
    import csv as csv_mod
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv_mod.DictReader(f) if r.get("megatrain/h2d_bytes")]
    assert [int(r["step"]) for r in rows] == expect
    assert [float(r["megatrain/h2d_bytes"]) for r in rows] == [hist[s]["megatrain/h2d_bytes"] for s in expect]
    # callbacks see them (ModelCheckpoint(monitor=...), EarlyStopping)
    assert set(keys) <= set(trainer.callback_metrics)
    assert trainer.callback_metrics["megatrain/h2d_bytes"].item() == hist[-1]["megatrain/h2d_bytes"]


def test_log_stats_false_logs_nothing(tmp_path):
    rec = _Recorder()
    trainer = _trainer(strategy=MegaTrainStrategy(log_stats=False), logger=[rec], log_every_n_steps=1, max_steps=3)
    trainer.fit(_UserLogLM(make_model("llama")), make_data(n=8))
    assert rec.steps_of("user_loss") == [0, 1, 2]
    assert not any(k.startswith("megatrain/") for _, m in rec.rows for k in m)
    assert not any(k.startswith("megatrain/") for k in trainer.callback_metrics)
    assert len(trainer.strategy.engine.history) == 3  # still measured


def test_stats_reach_callback_metrics_without_a_logger():
    trainer = _trainer(logger=False, max_steps=2)
    trainer.fit(LM(make_model("llama")), make_data(n=4))
    assert trainer.callback_metrics["megatrain/blocks_fetched"].item() == trainer.strategy.engine.history[-1][
        "megatrain/blocks_fetched"]


def test_the_first_steps_stats_leave_out_the_sanity_check():
    """Each step fetches the same blocks; the sanity check's validation batches before the first step are not
    counted in it."""
    trainer = _trainer(max_steps=3, num_sanity_val_steps=2, limit_val_batches=2, val_check_interval=3)
    trainer.fit(LM(make_model("llama")), make_data(n=16), make_data(n=4, seed=5))
    fetched = [row["megatrain/blocks_fetched"] for row in trainer.strategy.engine.history]
    assert len(fetched) == 3 and fetched[0] == fetched[1] == fetched[2] > 0, fetched


class _UnfreezeAtEpoch1(Callback):
    """BackboneFinetuning's pattern: layer 0 starts frozen and becomes trainable at epoch 1."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            for name, p in pl_module.named_parameters():
                if "layers.0." in name:
                    p.requires_grad_(True)


def _frozen_layer0() -> LM:
    model = make_model("llama")
    for name, p in model.named_parameters():
        if "layers.0." in name:
            p.requires_grad_(False)
    return LM(model)


def test_unfreezing_during_fit_is_refused_and_two_fits_train_like_plain_lightning():
    """Plain Lightning trains through an unfreeze at epoch 1; megatrain sizes its host gradient/AdamW state at
    setup, and the unfrozen layer's backward failed with "shape '[32, 32]' is invalid for input of size 0". Now the
    batch that would use it is refused up front naming the parameter, and the way the error names (fit with the
    layer frozen, unfreeze, fit again) gives plain Lightning's numbers."""
    ref = _frozen_layer0()
    _trainer(strategy="auto", max_epochs=2, max_steps=-1, callbacks=[_UnfreezeAtEpoch1()]).fit(ref, make_data(n=8))
    assert len(ref.losses) == 8  # the reference: Lightning itself supports this
    lm = _frozen_layer0()
    with pytest.raises(RuntimeError, match=r"parameter model\.model\.layers\.0\.\S+ was frozen .* trainable now"):
        _trainer(max_epochs=2, max_steps=-1, callbacks=[_UnfreezeAtEpoch1()]).fit(lm, make_data(n=8))
    assert len(lm.losses) == 4  # epoch 0 ran, nothing of epoch 1

    def two_fits(strategy):
        lm = _frozen_layer0()
        t = _trainer(strategy=strategy, max_epochs=1, max_steps=-1)
        t.fit(lm, make_data(n=8))
        for name, p in lm.named_parameters():
            if "layers.0." in name:
                p.requires_grad_(True)
        t.fit_loop.max_epochs = 2
        t.fit(lm, make_data(n=8))
        return lm

    ours, plain = two_fits("megatrain"), two_fits("auto")
    assert len(ours.losses) == 8
    assert_parity(ours.model, plain.model, ours.losses, plain.losses)
    assert rel(ours.model.model.layers[0].mlp.up_proj.weight, make_model("llama").model.layers[0].mlp.up_proj.weight) > 1e-4


def _backbone_finetuning():
    """Unfreeze ``BackboneLM.backbone`` at epoch 1 (lr 0.1 x the first group's), then its lr x2 per epoch."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    return BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 2.0)


@pytest.mark.parametrize("precision,kw", [("32-true", {}), ("bf16-mixed", {}), ("32-true", {"offload_optimizer": "nvme"})],
                         ids=["fp32", "bf16_mixed", "nvme_optimizer"])
def test_backbone_finetuning_trains_like_plain_lightning(tmp_path, precision, kw):
    """``BackboneFinetuning`` unfreezes layers and adds them to the optimizer at epoch 1 (accumulation 2, norm
    clipping). Before, the unfreeze was refused (the store had no gradient or AdamW state for parameters frozen at
    setup); with such a callback the store now keeps state for every parameter (``unfreeze_during_fit``), the new
    param group is mapped at the next step, and a block whose parameters were all frozen at setup takes part in
    backward once they train. Losses and weights: bitwise plain Lightning's; the backbone moved."""
    if "offload_optimizer" in kw:
        kw = {**kw, "nvme_path": str(tmp_path)}

    def run(strategy):
        lm = BackboneLM(make_model("llama"))
        t = _trainer(strategy=strategy, precision=precision, max_epochs=3, max_steps=-1, accumulate_grad_batches=2,
                     gradient_clip_val=0.5, callbacks=[_backbone_finetuning()])
        t.fit(lm, make_data(n=8))
        return lm, t

    (ours, t), (plain, _) = run(MegaTrainStrategy(**kw)), run("auto")
    assert [len(g["params"]) for g in t.optimizers[0].param_groups] == [20, 10]
    assert len(ours.losses) == 12 and ours.losses == plain.losses
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a.detach(), b.detach()), name
    assert rel(ours.model.model.embed_tokens.weight, make_model("llama").model.embed_tokens.weight) > 1e-4


def test_backbone_finetuning_resumes_like_plain_lightning(tmp_path):
    """Resume from the checkpoint saved after the unfreeze: ``BaseFinetuning`` restores its param groups in
    ``on_fit_start``, which Lightning calls before it restores callbacks when the strategy restores after setup (as
    megatrain does): the load failed with "Checkpoint has 2 param groups, the optimizer 1". The strategy now runs
    that hook again before the optimizer state is loaded. Losses and weights after resuming: bitwise plain
    Lightning's (which, resuming, leaves the restored backbone frozen: Lightning's own behaviour, kept)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(strategy, d):
        def trainer(epochs):
            return _trainer(strategy=strategy(), max_epochs=epochs, max_steps=-1, accumulate_grad_batches=2,
                            enable_checkpointing=True, default_root_dir=d,
                            callbacks=[_backbone_finetuning(), ModelCheckpoint(dirpath=d, save_top_k=-1)])

        trainer(2).fit(BackboneLM(make_model("llama")), make_data(n=8))
        lm = BackboneLM(make_model("llama"))
        trainer(3).fit(lm, make_data(n=8), ckpt_path=str(d / "epoch=1-step=4.ckpt"))
        return lm

    ours, plain = run(MegaTrainStrategy, tmp_path / "ours"), run(lambda: "auto", tmp_path / "plain")
    assert len(ours.losses) == 4 and ours.losses == plain.losses
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a.detach(), b.detach()), name


def _llama_frozen(*parts: str) -> BackboneLM:
    """A tiny Llama ``BackboneLM`` whose parameters with any of ``parts`` in their name start frozen."""
    model = make_model("llama")
    for name, p in model.named_parameters():
        if any(part in name for part in parts):
            p.requires_grad_(False)
    return BackboneLM(model)


class _UnfreezeIntoNewGroup(Callback):
    """A hand-written unfreeze at epoch 1: ``requires_grad_(True)`` and ``optimizer.add_param_group``."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            params = [p for name, p in pl_module.named_parameters() if "layers.0." in name or "embed" in name]
            for p in params:
                p.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": params, "lr": 2e-3})


@pytest.mark.parametrize("kw", [{}, {"offload_params": "nvme", "offload_optimizer": "nvme"}], ids=["ram", "nvme"])
def test_own_unfreeze_with_unfreeze_during_fit_trains_like_plain_lightning(tmp_path, kw):
    """``unfreeze_during_fit=True`` without a ``BaseFinetuning`` callback (a hand-written unfreeze; with the masters
    on NVMe too, where ``BaseFinetuning`` itself is refused): bitwise plain Lightning."""
    if kw:
        kw = {**kw, "nvme_path": str(tmp_path)}

    def run(strategy):
        lm = _llama_frozen("layers.0.", "embed")
        _trainer(strategy=strategy, max_epochs=2, max_steps=-1, accumulate_grad_batches=2, gradient_clip_val=0.5,
                 callbacks=[_UnfreezeIntoNewGroup()]).fit(lm, make_data(n=8))
        return lm

    ours, plain = run(MegaTrainStrategy(unfreeze_during_fit=True, **kw)), run("auto")
    assert ours.losses == plain.losses
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a.detach(), b.detach()), name


class _SwapLayerInGroup(Callback):
    """Layer at a time through one param group: epoch 1 adds layer 0 (frozen at setup); epoch 2 freezes it again,
    unfreezes layer 1 and replaces the group's ``params`` by layer 1's (the same number of tensors)."""

    def on_train_epoch_start(self, trainer, pl_module):
        opt, layers = trainer.optimizers[0], pl_module.model.model.layers
        if trainer.current_epoch in (1, 2):
            for p in layers[trainer.current_epoch - 1].parameters():
                p.requires_grad_(trainer.current_epoch == 1)
            params = list(layers[trainer.current_epoch - 1 if trainer.current_epoch == 1 else 1].parameters())
            for p in params:
                p.requires_grad_(True)
            if trainer.current_epoch == 1:
                opt.add_param_group({"params": params, "lr": 5e-3})
            else:
                opt.param_groups[1]["params"] = params


def test_a_param_group_whose_members_are_replaced_is_mapped_again():
    """The host optimizer maps parameters to groups again when a group's members change, not only its size:
    layer 1 swapped into a group in place of layer 0 (9 tensors each) trains. Bitwise plain Lightning; layer 1
    moved."""
    def run(strategy):
        lm = _llama_frozen("layers.0.", "layers.1.")
        _trainer(strategy=strategy, max_epochs=3, max_steps=-1, callbacks=[_SwapLayerInGroup()]).fit(lm, make_data(n=4))
        return lm

    ours, plain = run(MegaTrainStrategy(unfreeze_during_fit=True)), run("auto")
    assert ours.losses == plain.losses
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a.detach(), b.detach()), name
    assert rel(ours.model.model.layers[1].mlp.down_proj.weight, make_model("llama").model.layers[1].mlp.down_proj.weight) > 1e-2


def test_a_finetuning_callback_unfreezing_mid_epoch_sees_the_current_weights():
    """A ``BaseFinetuning`` subclass that unfreezes in ``on_train_batch_start``: Lightning's ``filter_on_optimizer``
    finds the parameters already in the optimizer by comparing values, and with the last update still pending
    (``overlap_optimizer``) layer 0's trained norms still equalled the frozen ones: they were left out of the new
    group (weights 3% off plain Lightning). The strategy now flushes before such a callback's batch hooks."""
    from lightning.pytorch.callbacks import BaseFinetuning

    class UnfreezeAtBatch1(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.backbone)

        def finetune_function(self, pl_module, epoch, optimizer):
            pass

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.current_epoch == 0 and batch_idx == 1:
                self.unfreeze_and_add_param_group(pl_module.backbone, trainer.optimizers[0], lr=5e-3)

    def run(strategy):
        lm = BackboneLM(make_model("llama"))
        t = _trainer(strategy=strategy, max_epochs=1, max_steps=-1, gradient_clip_val=0.5, callbacks=[UnfreezeAtBatch1()])
        t.fit(lm, make_data(n=8))
        return lm, t

    (ours, t), (plain, _) = run(MegaTrainStrategy()), run("auto")
    assert [len(g["params"]) for g in t.optimizers[0].param_groups] == [20, 10]
    assert ours.losses == plain.losses
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a.detach(), b.detach()), name


class _ReplaceGrads(Callback):
    """Gradient surgery out of place: ``p.grad = p.grad * 0.5 + 1e-3`` (or ``None`` for the embedding)."""

    def __init__(self, to_none: bool = False):
        self.to_none = to_none

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                p.grad = None if self.to_none and "embed_tokens" in name else p.grad * 0.5 + 1e-3


def test_gradients_replaced_in_on_before_optimizer_step_train_like_plain_lightning():
    """A hook that assigns a new tensor to ``param.grad`` was ignored (the host AdamW stepped from its own
    accumulators: losses 13% off plain Lightning after 6 steps). Now the new gradient is what is clipped and
    stepped, as in plain Lightning; setting ``param.grad = None`` (which plain AdamW skips) is an error."""
    def train(strategy, **kw):
        lm = LM(make_model("llama"), lr=1e-2)
        _trainer(strategy=strategy, callbacks=[_ReplaceGrads()], accumulate_grad_batches=2, **kw).fit(lm, make_data(n=24))
        return lm

    for kw in ({}, {"gradient_clip_val": 0.05}):
        ours, plain = train("megatrain", **kw), train("auto", **kw)
        assert_parity(ours.model, plain.model, ours.losses, plain.losses)
    lm = LM(make_model("llama"))
    with pytest.raises(RuntimeError, match=r"set model\.model\.embed_tokens\.weight\.grad to None .*requires_grad_"):
        _trainer(callbacks=[_ReplaceGrads(to_none=True)]).fit(lm, make_data(n=8))


def test_stochastic_weight_averaging_and_epoch_end_reads_train_like_plain_lightning():
    """``on_train_epoch_end`` sees the weights of the epoch's last step (before, the pending update was applied
    only later: ``StochasticWeightAveraging`` averaged weights one step old, and the update applied at the end of
    ``fit`` overwrote the average it had copied into the parameters)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class EpochEndWeights(Callback):
        def __init__(self):
            self.seen: list[torch.Tensor] = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.seen.append(torch.cat([p.detach().flatten() for p in pl_module.parameters()]))

    def run(strategy):
        lm, cb = LM(make_model("llama"), lr=1e-2), EpochEndWeights()
        swa = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)
        _trainer(strategy=strategy, max_steps=-1, max_epochs=3, callbacks=[cb, swa]).fit(lm, make_data(n=8))
        return lm, cb.seen

    (ours, seen), (plain, plain_seen) = run("megatrain"), run("auto")
    assert_parity(ours.model, plain.model, ours.losses, plain.losses)
    assert len(seen) == len(plain_seen) == 3
    for a, b in zip(seen, plain_seen):
        assert rel(a, b) <= 1e-5


@pytest.mark.parametrize("precision,kw", [("32-true", {}), ("32-true", {"cpu_zero_copy": False}), ("bf16-mixed", {})],
                         ids=["fp32", "fp32_copies", "bf16_mixed"])
def test_ema_weight_averaging_trains_and_validates_like_plain_lightning(precision, kw):
    """Lightning's ``EMAWeightAveraging``: averages after every optimizer step (``on_train_batch_end``), swaps the
    average in for validation and back through ``param.data``, copies it into the model at the end (accumulation 2:
    the flush runs once per optimizer step, not per micro-batch). Before, it
    averaged weights one step old (final weights 2% off) and, under bf16-mixed, validation and training after it
    read 16-bit wire images cached before the swap (0.4% off). Validation losses and final weights: bitwise."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    class ValLM(LM):
        def __init__(self, model):
            super().__init__(model)
            self.val: list[float] = []

        def validation_step(self, batch, batch_idx):
            loss = super().validation_step(batch, batch_idx)
            self.val.append(loss.item())
            return loss

    def run(strategy):
        lm = ValLM(make_model("llama"))
        _trainer(strategy=strategy, precision=precision, callbacks=[EMAWeightAveraging(decay=0.5)], val_check_interval=4,
                 limit_val_batches=2, accumulate_grad_batches=2).fit(lm, make_data(n=24), make_data(n=8, seed=5))
        return lm

    ours, plain = run(MegaTrainStrategy(**kw)), run("auto")
    assert ours.losses == plain.losses and len(ours.val) == len(plain.val) > 0
    assert ours.val == plain.val
    for (name, a), b in zip(ours.named_parameters(), plain.parameters()):
        assert torch.equal(a.detach(), b.detach()), name


def test_bf16_parameters_are_trained_as_fp32_masters_with_a_warning(caplog):
    """A model loaded in bf16 (``torch_dtype=torch.bfloat16``) trains from fp32 masters, as the same model
    upcast to fp32 does, and comes back fp32; a warning says so (plain Lightning would update the bf16 weights:
    other numbers). Before, nothing was said."""
    lm = LM(make_model("llama").to(torch.bfloat16))
    ref = LM(make_model("llama").to(torch.bfloat16).float())
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning"):
        _trainer(max_steps=2).fit(lm, make_data(n=4))
    assert any("torch.bfloat16" in r.getMessage() and "fp32" in r.getMessage() for r in caplog.records)
    assert all(p.dtype == torch.float32 for p in lm.parameters())
    _trainer(max_steps=2).fit(ref, make_data(n=4))
    assert_parity(lm.model, ref.model, lm.losses, ref.losses)


def test_zero_grad_keeping_zero_gradients_warns(monkeypatch):
    """``optimizer.zero_grad(set_to_none=False)`` cannot keep zero gradients (they live in host accumulators), so a
    parameter without a gradient in a step is not updated where torch's AdamW would move it: said once, not silent."""
    import megatrain_lightning.optim.takeover as S

    monkeypatch.setattr(S, "_ZERO_GRAD_WARNED", False)

    class Kept(LM):
        def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
            optimizer.zero_grad(set_to_none=False)

    with pytest.warns(UserWarning, match=r"zero_grad\(set_to_none=False\) acts as set_to_none=True"):
        _trainer(max_steps=2).fit(Kept(make_model("llama")), make_data())
