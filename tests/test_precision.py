"""MegaTrainPrecision: fp32 masters on the host whatever the compute precision."""

from __future__ import annotations

import copy
import math

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

import megatrain_lightning  # noqa: F401
from megatrain_lightning import MegaTrainPrecision, MegaTrainStrategy
from megatrain_lightning.engine.wire import WireLayout
from megatrain_lightning.testing import LM, SEQ, learnable_data, make_data, make_model, rel


def fit(model, steps, data=None, **kw):
    lm = LM(model, lr=3e-3)
    base = dict(strategy="megatrain", accelerator="cpu", max_steps=steps, enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False)
    base.update(kw)
    trainer = pl.Trainer(**base)
    trainer.fit(lm, data or learnable_data())
    return lm, trainer


def test_32_true_is_bitwise_the_default_path():
    model = make_model("llama")
    runs = [fit(copy.deepcopy(model), 10, data=make_data()),
            fit(copy.deepcopy(model), 10, data=make_data(), precision="32-true"),
            fit(copy.deepcopy(model), 10, data=make_data(), plugins=[MegaTrainPrecision("32-true")])]
    for lm, _ in runs[1:]:
        assert lm.losses == runs[0][0].losses
        for a, b in zip(lm.parameters(), runs[0][0].parameters()):
            assert torch.equal(a, b)


class FetchSpy(Callback):
    """Counts the wire bytes of every slab fetch the engine makes (prefetches that are dropped included)."""

    def __init__(self):
        self.wire_bytes = 0

    def on_fit_start(self, trainer, pl_module):
        engine = trainer.strategy.engine
        fetch = engine.fetcher.fetch

        def spy(blk):
            self.wire_bytes += sum(engine.wire_layouts[si].nbytes for si in blk.slabs)
            return fetch(blk)

        engine.fetcher.fetch = spy


def _h2d_total(trainer):
    engine = trainer.strategy.engine
    return sum(h["megatrain/h2d_bytes"] for h in engine.history) + engine.stats.h2d_bytes


def test_bf16_mixed_follows_fp32_and_counts_h2d_exactly():
    model = make_model("llama")
    spy32, spy16 = FetchSpy(), FetchSpy()
    # cpu_zero_copy=False: every fetch is a copy, as on an accelerator (zero-copy binds what is already fp32: not
    # copied, not counted in h2d_bytes)
    fp32, t32 = fit(copy.deepcopy(model), 100, callbacks=[spy32], strategy=MegaTrainStrategy(cpu_zero_copy=False))
    bf16, t16 = fit(copy.deepcopy(model), 100, precision="bf16-mixed", callbacks=[spy16],
                    strategy=MegaTrainStrategy(cpu_zero_copy=False))
    assert isinstance(t16.strategy.precision_plugin, MegaTrainPrecision)
    assert t16.strategy.precision_plugin.precision == "bf16-mixed"
    assert all(math.isfinite(x) for x in bf16.losses)
    assert fp32.losses[-1] < 0.5 * fp32.losses[0]  # the task is learnable: the comparison means something
    final32 = sum(fp32.losses[-10:]) / 10
    final16 = sum(bf16.losses[-10:]) / 10
    assert abs(final16 - final32) / final32 <= 0.02, (final16, final32)
    # h2d_bytes counts exactly the bytes of the wire layouts fetched; castable weights travel in 2 bytes,
    # embeddings and norms in 4 (each run of a mixed slab padded to 16 bytes)
    engine = t16.strategy.engine
    for slab, layout, flags in zip(engine.store.slabs, engine.wire_layouts, engine.autocast_castable):
        exact = sum((2 if c else 4) * e.numel for e, c in zip(slab.entries, flags))
        assert exact <= layout.nbytes < exact + 16 * len(layout.runs)
    assert _h2d_total(t32) == spy32.wire_bytes == 4 * spy32.wire_bytes // 4
    assert _h2d_total(t16) == spy16.wire_bytes
    # this tiny Llama's embedding is 9% of its parameters and stays fp32: 0.551 of fp32's bytes
    assert _h2d_total(t16) < 0.56 * _h2d_total(t32)
    # masters stay fp32
    assert all(p.dtype == torch.float32 for p in bf16.parameters())


def _wire_params(engine):
    """Parameter names by wire dtype class: castable (bf16/fp16 on the link) or fp32."""
    names = {id(p): n for n, p in engine.root.named_parameters()}
    cast, keep = set(), set()
    for slab, flags in zip(engine.store.slabs, engine.autocast_castable):
        for e, c in zip(slab.entries, flags):
            (cast if c else keep).add(names[id(e.ref.param)].removeprefix("model."))
    return cast, keep


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "gpt2"])
def test_wire_rule_streams_only_what_autocast_casts(arch):
    """Linear / Conv1D weights and biases travel in bf16; embeddings, norms and a weight tied between the
    embedding lookup and the LM head travel in fp32 (the lookup must see fp32, as under Lightning)."""
    _, trainer = fit(make_model(arch), 1, precision="bf16-mixed", data=make_data())
    cast, keep = _wire_params(trainer.strategy.engine)
    if arch == "gpt2":
        assert cast == {f"transformer.h.{i}.{m}.{a}" for i in range(3) for m in ("attn.c_attn", "attn.c_proj",
                        "mlp.c_fc", "mlp.c_proj") for a in ("weight", "bias")}
        assert keep == {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
                        "transformer.ln_f.bias"} | {f"transformer.h.{i}.{ln}.{a}" for i in range(3)
                                                    for ln in ("ln_1", "ln_2") for a in ("weight", "bias")}
        return
    layers = {f"model.layers.{i}.{m}.weight" for i in range(3) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    norms = {f"model.layers.{i}.{n}.weight" for i in range(3) for n in ("input_layernorm", "post_attention_layernorm")}
    head = set() if arch == "llama_tied" else {"lm_head.weight"}
    assert cast == layers | head
    assert keep == norms | {"model.embed_tokens.weight", "model.norm.weight"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wire_cast_is_bitwise_autocasts_cast(dtype):
    """The host cast of a castable weight equals autocast's own cast bit for bit (round to nearest even,
    overflow to inf, subnormals), so F.linear under autocast gives the same result on the streamed weight."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g) * torch.logspace(-42, 5, 48)  # subnormal to overflowing magnitudes
    w[0, :4] = torch.tensor([65520.0, -0.0, 1e-45, 3.0e38])
    norm = torch.randn(48, generator=g)
    master = torch.cat([w.reshape(-1), norm])
    layout = WireLayout.build([w.numel(), norm.numel()], [dtype, torch.float32])
    assert layout.dtype is None and len(layout.runs) == 2
    image = layout.encode(master, layout.empty())
    assert image.numel() == layout.nbytes == w.numel() * 2 + norm.numel() * 4
    out = layout.decode(image, torch.empty(master.numel()))
    rebuilt_w, rebuilt_norm = out[: w.numel()].view(w.shape), out[w.numel():]
    assert torch.equal(rebuilt_w.to(dtype).view(torch.int16), w.to(dtype).view(torch.int16))
    assert torch.equal(rebuilt_norm, norm)  # fp32 runs travel unchanged
    x = torch.randn(8, 48, generator=g)
    with torch.autocast("cpu", dtype=dtype):
        got, want = torch.nn.functional.linear(x, rebuilt_w), torch.nn.functional.linear(x, w)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # inf weights give NaNs in both


def _fit_pair(arch, steps, precision, opt_kwargs):
    """Ours and plain Lightning (strategy="auto") from the same weights, seed and data."""
    runs = []
    # the configs' default use_cache=True: each block run gets a fresh copy of the empty KV cache, so its
    # keys have the memory layout plain PyTorch gives them (when the engine dropped the cache, the CPU fp16
    # bmm summed GPT-2's keys in another order: one fp16 ulp in 2 gradient elements at step 9 of 16-mixed)
    model = make_model(arch)
    for strategy in ("megatrain", "auto"):
        lm = LM(copy.deepcopy(model), lr=3e-3, opt_kwargs=opt_kwargs)
        if precision == "16-mixed":  # on CPU Lightning turns precision="16-mixed" into bf16: build fp16 plugins
            kw = {"plugins": [MegaTrainPrecision("16-mixed") if strategy == "megatrain"
                              else MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
        else:
            kw = {"precision": precision}
        torch.manual_seed(0)
        pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, enable_checkpointing=False,
                   logger=False, enable_progress_bar=False, enable_model_summary=False, **kw
                   ).fit(lm, make_data(n=2 * steps))
        runs.append(lm)
    return runs


@pytest.mark.parametrize("precision,arch", [("bf16-mixed", "llama"), ("bf16-mixed", "llama_tied"), ("bf16-mixed", "gpt2"),
                                            ("16-mixed", "llama"), ("16-mixed", "llama_tied"), ("16-mixed", "gpt2")])
def test_mixed_precision_is_lightnings(precision, arch):
    """18 steps against plain Lightning's own bf16-mixed / 16-mixed (fp32 weights under autocast, GradScaler
    for fp16), both with torch's fused AdamW (which HostAdamW then runs too), so only the precision semantics
    are compared. Measured: losses and weights bitwise equal in all six cases. Before the wire rule (every
    weight rounded to bf16, norms and embeddings included), bf16-mixed llama ended 1.3e-3 (losses) and
    3.5e-2 (weights, relative norm) from Lightning."""
    ours, ref = _fit_pair(arch, 18, precision, {"fused": True})
    assert ours.losses == ref.losses
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), q.detach()), (n, rel(p.detach(), q.detach()))


def test_bf16_mixed_with_default_adamw_is_lightnings():
    """With torch's default AdamW (the for-loop kernel on CPU tensors) the host optimizer runs the same
    kernel as Lightning's side, so losses and weights are bitwise equal after 18 steps. Before (the host
    always ran the fused kernel) the optimizers differed in the last fp32 bit, which bf16 rounding of the
    weights amplified: losses 3.5e-5 apart (1.35e-3 before the wire rule)."""
    ours, ref = _fit_pair("llama", 18, "bf16-mixed", None)
    assert ours.losses == ref.losses
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), (n, rel(p.detach(), q.detach()))


def test_bf16_grads_halve_d2h_and_are_exact_for_castable_weights():
    """grad_dtype="bf16": half the D2H bytes. A castable weight's gradient is a bf16 matmul's output, so
    it crosses unchanged; only the gradients of fp32-wire parameters (embedding, norms) are rounded."""
    grads = []

    class Grab(LM):
        def on_before_optimizer_step(self, optimizer):
            grads.append({n: p.grad.clone() for n, p in self.named_parameters()})

    model = make_model("llama")
    trainers = []
    for plugin in (MegaTrainPrecision("bf16-mixed"), MegaTrainPrecision("bf16-mixed", grad_dtype="bf16")):
        trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=1, plugins=[plugin], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Grab(copy.deepcopy(model)), make_data())
        trainers.append(trainer)
    d32, d16 = (t.strategy.engine.history[-1]["megatrain/d2h_bytes"] for t in trainers)
    ids = 2 * SEQ * 8  # the embedding's row ids (engine/row_grads.py): 8 bytes per token whatever the wire
    assert d16 - ids == (d32 - ids) / 2
    cast, keep = _wire_params(trainers[0].strategy.engine)
    for n in cast:
        assert torch.equal(grads[0]["model." + n], grads[1]["model." + n]), n
    rounded = [n for n in keep if not torch.equal(grads[0]["model." + n], grads[1]["model." + n])]
    assert "model.embed_tokens.weight" in rounded


def test_bf16_true_trains_with_fp32_masters():
    lm, trainer = fit(make_model("llama"), 40, precision="bf16-true")
    assert lm.losses[-1] < 0.8 * lm.losses[0]
    assert all(p.dtype == torch.float32 for p in lm.parameters())


def test_bf16_true_computes_the_first_step_as_lightning():
    """Before any update the two paths compute the same bf16 forward: Lightning's ``bf16-true`` casts the module,
    buffers included (the rotary ``inv_freq``), and the strategy casts the buffers while keeping fp32 masters.
    After the first update they differ by design (Lightning steps bf16 weights)."""
    model = make_model("llama")
    firsts = []
    for strategy in ("auto", "megatrain"):
        lm, _ = fit(copy.deepcopy(model), 1, data=make_data(), precision="bf16-true", strategy=strategy)
        assert lm.model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
        firsts.append(lm.losses[0])
    assert firsts[0] == firsts[1], firsts


class Snapshots(Callback):
    """Weights and AdamW state after every step (flushed, so pending updates are applied)."""

    def __init__(self):
        self.weights, self.steps, self.exp_avg = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.strategy.flush()
        opt = trainer.strategy.engine.optimizer
        self.weights.append([p.detach().clone() for p in pl_module.parameters()])
        self.steps.append([t.item() if t is not None else 0 for s in opt.steps for t in s])
        self.exp_avg.append([m.clone() for m in opt.exp_avg if m is not None])


def test_fp16_overflow_skips_exactly_that_step():
    bad_step = 3

    class Overflow(LM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * float("inf") if batch_idx == bad_step else loss

    model = make_model("llama")
    snaps = Snapshots()
    plugin = MegaTrainPrecision("16-mixed")
    lm = Overflow(model, lr=3e-3)
    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=6, plugins=[plugin], callbacks=[snaps],
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(lm, learnable_data())
    assert plugin.skipped_steps == 1
    assert plugin.scale == 2.0**16 * 0.5
    before, after = bad_step - 1, bad_step
    for a, b in zip(snaps.weights[before], snaps.weights[after]):
        assert torch.equal(a, b)
    assert snaps.steps[after] == snaps.steps[before]
    for a, b in zip(snaps.exp_avg[before], snaps.exp_avg[after]):
        assert torch.equal(a, b)
    # the steps around it did update
    assert any(not torch.equal(a, b) for a, b in zip(snaps.weights[after], snaps.weights[after + 1]))
    assert all(math.isfinite(x) for x in lm.losses)


def test_fp16_mixed_trains_and_scaler_state_roundtrips():
    plugin = MegaTrainPrecision("16-mixed", growth_interval=5)
    lm, trainer = fit(make_model("llama"), 12, plugins=[plugin])
    assert lm.losses[-1] < lm.losses[0]
    assert plugin.scale == 2.0**16 * 4  # grew twice (5 and 10 clean steps)
    state = plugin.state_dict()
    other = MegaTrainPrecision("16-mixed")
    other.load_state_dict(state)
    assert other.state_dict() == state == {"scale": 2.0**18, "growth_tracker": 2, "skipped_steps": 0,
                                           "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5}


def test_a_users_grad_scaler_settings_are_kept():
    """``plugins=[MixedPrecision("16-mixed", "cpu", scaler=GradScaler(init_scale=2**10, growth_interval=2))]``: the
    strategy's own plugin takes the scaler's settings (they were dropped for the defaults, silently) and its scale
    moves as plain Lightning's scaler does."""
    def plugin():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2))

    model = make_model("llama")
    lm, trainer = fit(copy.deepcopy(model), 6, plugins=[plugin()])
    ours = trainer.precision_plugin
    assert isinstance(ours, MegaTrainPrecision) and ours.growth_interval == 2
    plain = plugin()
    ref, _ = fit(copy.deepcopy(model), 6, strategy="auto", plugins=[plain])
    assert ours.scale == plain.scaler.get_scale() == 2.0**13  # grew after steps 2, 4 and 6
    for a, b in zip(lm.losses, ref.losses):
        assert abs(a - b) <= 1e-3 * abs(b)


def test_scaler_state_is_in_lightning_checkpoint(tmp_path):
    plugin = MegaTrainPrecision("16-mixed", growth_interval=3)
    lm, trainer = fit(make_model("llama"), 4, plugins=[plugin])
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ck = torch.load(tmp_path / "c.ckpt" / "trainer.pt", weights_only=True)
    assert ck["MegaTrainPrecision"]["scale"] == 2.0**17


def test_recompute_runs_under_the_forward_precision():
    """Backward recompute replays autocast on the streamed weights: the gradients are bitwise those of a
    plain bf16 autocast step on the fp32 model (norms and embeddings see fp32, matmuls bf16)."""
    model = make_model("llama", use_cache=False)
    ref = copy.deepcopy(model)
    grads = {}

    class Grab(LM):
        def on_before_optimizer_step(self, optimizer):
            for n, p in self.named_parameters():
                grads[n] = p.grad.clone()

    lm = Grab(model)
    pl.Trainer(strategy="megatrain", accelerator="cpu", max_steps=1, precision="bf16-mixed", logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
               ).fit(lm, make_data())
    (ids,) = next(iter(make_data()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ref(input_ids=ids, labels=ids).loss
    loss.backward()
    for n, p in ref.named_parameters():
        assert p.grad.dtype == grads["model." + n].dtype == torch.float32
        assert torch.equal(grads["model." + n], p.grad), n


class _Features(pl.LightningModule):
    """Float features through two Linear blocks; ``training_step`` records the batch's dtype and torch's default dtype
    and adds a tensor it creates itself (it must have the default dtype, as under Lightning's ``bf16-true``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def training_step(self, batch, i):
        x, y = batch
        self.seen.append((x.dtype, torch.get_default_dtype()))
        h = x + torch.ones(8) * 0.1
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return torch.nn.functional.mse_loss(h.float(), y.float())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_bf16_true_casts_the_batch_and_sets_the_default_dtype_as_lightning():
    """``precision="bf16-true"`` with a float batch: Lightning casts it to bf16 and makes bf16 the default dtype in
    the step, and so does the strategy. Masters stay fp32 here (unlike Lightning's), so the numbers are not
    compared."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g),
                                                                      torch.randn(16, 8, generator=g)), batch_size=4)
    seen = {}
    for strategy in ("auto", MegaTrainStrategy(block_names=["layers.*"])):
        lm = _Features()
        pl.Trainer(strategy=strategy, accelerator="cpu", precision="bf16-true", max_steps=3, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(lm, data)
        seen[str(strategy)] = lm.seen
        assert torch.get_default_dtype() == torch.float32  # restored after each step
    plain, ours = seen.values()
    assert ours == plain == [(torch.bfloat16, torch.bfloat16)] * 3


def test_a_disabled_grad_scaler_is_fp16_autocast_without_loss_scaling():
    """``MixedPrecision("16-mixed", scaler=GradScaler(enabled=False))``: Lightning runs fp16 autocast without loss
    scaling, and so does the strategy (its plugin takes over the disabled scaler's settings)."""
    def plugin():
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))

    model = make_model("llama")
    lm, trainer = fit(copy.deepcopy(model), 4, plugins=[plugin()])
    ours = trainer.precision_plugin
    assert isinstance(ours, MegaTrainPrecision) and not ours.scaling and ours.state_dict() == {}
    ref, _ = fit(copy.deepcopy(model), 4, strategy="auto", plugins=[plugin()])
    for a, b in zip(lm.losses, ref.losses):
        assert abs(a - b) <= 1e-3 * abs(b)


def test_the_exported_lightning_file_keeps_the_fp16_loss_scale(tmp_path):
    """``python -m megatrain_lightning.export DIR --lightning-ckpt F`` wrote the loss scale only in our plugin's format;
    F holds the loss scale also in ``torch.amp.GradScaler.state_dict()`` format under ``MixedPrecision``, which
    Lightning's plugin loads, so ``strategy="auto"`` resuming from F continues from it."""
    from megatrain_lightning.checkpoint.lightning_file import convert_to_lightning_checkpoint

    plugin = MegaTrainPrecision("16-mixed", init_scale=2.0**10, growth_interval=3)
    lm, trainer = fit(make_model("llama"), 4, plugins=[plugin])
    assert plugin.scale == 2.0**11 and plugin.growth_tracker == 1
    trainer.save_checkpoint(tmp_path / "dir")
    convert_to_lightning_checkpoint(tmp_path / "dir", tmp_path / "f.ckpt")
    ck = torch.load(tmp_path / "f.ckpt", weights_only=True)
    assert ck["MixedPrecision"] == {"scale": 2.0**11, "growth_factor": 2.0, "backoff_factor": 0.5,
                                    "growth_interval": 3, "_growth_tracker": 1}
    plain = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    t2 = pl.Trainer(strategy="auto", accelerator="cpu", max_steps=4, plugins=[plain], enable_checkpointing=False,
                    logger=False, enable_progress_bar=False, enable_model_summary=False)
    t2.fit(LM(make_model("llama"), lr=3e-3), learnable_data(), ckpt_path=tmp_path / "f.ckpt")
    assert plain.scaler.get_scale() == 2.0**11 and plain.scaler.get_growth_interval() == 3
