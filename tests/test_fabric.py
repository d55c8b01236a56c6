"""``Fabric(strategy="megatrain")`` against ``Fabric(strategy="auto")``: a LitGPT-shaped loop (accumulation with
``no_backward_sync``, ``clip_gradients``, a cosine schedule) gives the same losses, weights and AdamW state; a save
at step 5 + load + 5 steps equals 10 steps; checkpoints move between the Fabric and Trainer strategies; what Fabric
allows and the engine cannot do is refused at setup."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.fabric import Fabric

import megatrain_lightning  # noqa: F401  (registers the strategies)
from megatrain_lightning.fabric import MegaTrainFabricStrategy
from megatrain_lightning.optim.host_adamw import UnsupportedOptimizerError
from megatrain_lightning.precision import UnsupportedPrecisionError
from megatrain_lightning.testing import batch_inputs, make_data, make_model

STEPS, ACC = 10, 2


def _batches(n: int) -> list:
    it, out = iter(make_data(n=64)), []
    while len(out) < n:
        try:
            out.append(next(it))
        except StopIteration:
            it = iter(make_data(n=64))
    return out


def _fabric(strategy: str, precision: str = "32-true") -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1, precision=precision)
    fabric.launch()
    return fabric


def _setup(fabric: Fabric, arch: str = "llama", model=None):
    fabric.seed_everything(0)
    model = model if model is not None else make_model(arch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    model, opt = fabric.setup(model, opt)
    return model, opt, sched


def _loop(fabric, model, opt, sched, batches, first: int, last: int, loss_fn=None):
    """Optimizer steps ``first`` .. ``last - 1`` of LitGPT's full fine-tuning loop shape."""
    losses, norms = [], []
    for i in range(first * ACC, last * ACC):
        accumulating = (i + 1) % ACC != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = loss_fn(model, batches[i]) if loss_fn else model(**batch_inputs(batches[i])).loss
            fabric.backward(loss / ACC)
        losses.append(loss.item())
        if not accumulating:
            norms.append(fabric.clip_gradients(model, opt, max_norm=0.5).item())
            opt.step()
            opt.zero_grad()
            sched.step()
    return losses, norms


def _weights(fabric, model) -> dict[str, torch.Tensor]:
    """The weights after the loop, read with ``model.state_dict()`` (which applies the pending updates)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _adam(opt) -> dict:
    return {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in opt.state_dict()["state"].items()}


def _run(strategy: str, precision: str = "32-true", arch: str = "llama"):
    fabric = _fabric(strategy, precision)
    model, opt, sched = _setup(fabric, arch)
    losses, norms = _loop(fabric, model, opt, sched, _batches(STEPS * ACC), 0, STEPS)
    return losses, norms, _weights(fabric, model), _adam(opt), fabric


def _assert_same(a, b, exact: bool = True, tol: float = 0.0):
    check = torch.equal if exact else (lambda x, y: torch.allclose(x, y, rtol=tol, atol=tol))
    assert a[0] == b[0] if exact else torch.allclose(torch.tensor(a[0]), torch.tensor(b[0]), rtol=tol, atol=tol)
    assert a[1] == pytest.approx(b[1], rel=tol, abs=tol)
    assert a[2].keys() == b[2].keys()
    bad = [k for k in a[2] if not check(a[2][k], b[2][k])]
    assert not bad, bad[:5]
    for i in a[3]:
        for k in ("exp_avg", "exp_avg_sq"):
            assert check(a[3][i][k], b[3][i][k]), (i, k)


def test_fp32_loop_is_bitwise_fabric_auto():
    ref = _run("auto")
    got = _run("megatrain")
    assert isinstance(got[4].strategy, MegaTrainFabricStrategy)
    _assert_same(got, ref)


def test_bf16_mixed_matches_fabric_bf16_mixed():
    ref = _run("auto", "bf16-mixed")
    got = _run("megatrain", "bf16-mixed")
    _assert_same(got, ref)


def test_save_at_step_5_load_and_5_more_equals_10(tmp_path):
    batches = _batches(STEPS * ACC)
    full = _run("megatrain")
    fabric = _fabric("megatrain")
    model, opt, sched = _setup(fabric)
    first, _ = _loop(fabric, model, opt, sched, batches, 0, 5)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt, "scheduler": sched, "step": 5})
    assert (tmp_path / "ckpt" / "model" / "config.json").exists() and (tmp_path / "ckpt" / "optimizer").is_dir()

    fabric2 = _fabric("megatrain")
    fabric2.seed_everything(0)
    with fabric2.init_module(empty_init=True):  # parameters on meta: the store starts as zeros, the load fills it
        model2 = make_model("llama", seed=123)
    assert all(p.is_meta for p in model2.parameters())
    with pytest.raises(RuntimeError, match="setup_module"):
        fabric2.setup(model2, torch.optim.AdamW(model2.parameters()))
    model2 = fabric2.setup_module(model2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3, weight_decay=0.01)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=STEPS)
    opt2 = fabric2.setup_optimizers(opt2)
    with pytest.raises(KeyError, match="'epoch' that does not exist"):  # Fabric's strict loading
        fabric2.load(tmp_path / "ckpt", {"model": model2, "epoch": 0})
    state = {"model": model2, "optimizer": opt2, "scheduler": sched2, "step": 0}
    rest = fabric2.load(tmp_path / "ckpt", state)
    assert state["step"] == 5 and rest == {}
    second, _ = _loop(fabric2, model2, opt2, sched2, batches, 5, STEPS)
    assert first + second == full[0]
    w = _weights(fabric2, model2)
    assert all(torch.equal(w[k], full[2][k]) for k in w)
    adam = _adam(opt2)
    assert all(torch.equal(adam[i]["exp_avg_sq"], full[3][i]["exp_avg_sq"]) for i in adam)


def test_refusals_at_setup(tmp_path):
    fabric = _fabric("megatrain")
    model = make_model("llama")
    a = torch.optim.AdamW(model.parameters())
    b = torch.optim.AdamW(model.parameters())
    with pytest.raises(UnsupportedOptimizerError, match="exactly one optimizer"):
        fabric.setup(model, a, b)
    other = make_model("llama")
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS.*closure"):
        fabric.setup(other, torch.optim.LBFGS(other.parameters(), lr=0.1))
    fabric = _fabric("megatrain")
    m = fabric.setup_module(make_model("llama"))
    with pytest.raises(NotImplementedError, match="streams one model"):
        fabric.setup_module(make_model("llama"))
    opt = fabric.setup_optimizers(torch.optim.AdamW(m.parameters()))
    with pytest.raises(ValueError, match="filter"):
        fabric.save(tmp_path / "c", {"model": m, "optimizer": opt}, filter={"model": lambda k, v: True})
    with pytest.raises(ValueError, match="does not train"):
        fabric.save(tmp_path / "c", {"model": m, "other": torch.nn.Linear(2, 2)})

    from lightning.fabric.plugins import TorchCheckpointIO

    from megatrain_lightning import CheckpointError

    class Uploading(TorchCheckpointIO):
        pass

    fabric = Fabric(strategy="megatrain", accelerator="cpu", devices=1, plugins=[Uploading()])
    fabric.launch()
    with pytest.raises(CheckpointError, match="Uploading.*would not be used"):
        fabric.setup_module(make_model("llama"))


def test_unsupported_precision_is_refused():
    with pytest.raises(UnsupportedPrecisionError, match="16-true"):
        Fabric(strategy="megatrain", accelerator="cpu", devices=1, precision="16-true")


def _trainer(max_steps: int):
    import lightning.pytorch as pl

    return pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=ACC,
                      gradient_clip_val=0.5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)


def _lm(seed: int = 0):
    from megatrain_lightning.testing import LM

    return LM(make_model("llama", seed=seed), lr=1e-3, sched="cosine", total_steps=STEPS,
              opt_kwargs={"weight_decay": 0.01})


def test_checkpoints_move_between_the_trainer_and_fabric(tmp_path):
    """Trainer (a LightningModule holding the HF model) 5 steps -> fabric.load into the HF model itself -> 5 steps; and
    Fabric 5 steps -> Trainer fit(ckpt_path=) 5 steps: both equal 10 uninterrupted steps."""
    from torch.utils.data import DataLoader

    batches = _batches(STEPS * ACC)
    full = _run("megatrain")

    lm = _lm()
    trainer = _trainer(5)
    trainer.fit(lm, DataLoader(batches[: 5 * ACC], batch_size=None))
    trainer.save_checkpoint(tmp_path / "from_trainer")
    fabric = _fabric("megatrain")
    model, opt, sched = _setup(fabric, model=make_model("llama", seed=123))
    fabric.load(tmp_path / "from_trainer", {"model": model, "optimizer": opt, "scheduler": sched})
    second, _ = _loop(fabric, model, opt, sched, batches, 5, STEPS)
    assert lm.losses + second == full[0]
    w = _weights(fabric, model)
    assert all(torch.equal(w[k], full[2][k]) for k in w)

    fabric = _fabric("megatrain")
    model, opt, sched = _setup(fabric)
    _loop(fabric, model, opt, sched, batches, 0, 5)
    fabric.save(tmp_path / "from_fabric", {"model": model, "optimizer": opt, "scheduler": sched, "step": 5})
    lm = _lm(seed=123)
    trainer = _trainer(5)  # Fabric has no Lightning loops: the Trainer counts its steps from 0
    trainer.fit(lm, DataLoader(batches[5 * ACC:], batch_size=None), ckpt_path=tmp_path / "from_fabric")
    assert lm.losses == full[0][5 * ACC:]
    trainer.strategy.flush()
    w = {k.removeprefix("model."): v for k, v in lm.state_dict().items()}
    assert all(torch.equal(w[k], full[2][k]) for k in full[2])


def test_two_processes_gloo_match_fabric_ddp(tmp_path):
    """``Fabric(strategy="megatrain", devices=2)`` (gloo, Lightning's launcher starting rank 1) against Fabric's DDP:
    the same losses on every rank and the same final weights, within 1e-5 relative (DDP sums the two micro-batches
    of a rank before its all-reduce; megatrain averages each micro-batch's gradients as they are made)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker = Path(__file__).with_name("fabric_worker.py")
    for i, strategy in enumerate(("megatrain", "ddp")):
        env["MASTER_PORT"] = str(port + i)
        proc = subprocess.run([sys.executable, str(worker), str(tmp_path), strategy], env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got, ref = torch.load(tmp_path / "megatrain.pt"), torch.load(tmp_path / "ddp.pt")
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    for k, v in ref["weights"].items():
        err = ((got["weights"][k].double() - v.double()).norm() / v.double().norm().clamp_min(1e-30)).item()
        assert err <= 1e-5, (k, err)
    from safetensors.torch import load_file

    saved = {}
    for f in (tmp_path / "megatrain_ckpt" / "model").glob("*.safetensors"):
        saved.update(load_file(f))
    assert saved.keys() <= got["weights"].keys() and len(saved) >= len(got["weights"]) - 1
    assert all(torch.equal(saved[k], got["weights"][k]) for k in saved)  # the ranks' slabs, written together
    fabric = _fabric("megatrain")  # and it resumes in one process: weights, AdamW state, scheduler, step
    model = fabric.setup_module(make_model("llama", seed=5))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    fabric.load(tmp_path / "megatrain_ckpt", state)
    assert state["step"] == 6 and sched.last_epoch == 6 and len(_adam(opt)) == len(list(model.parameters()))
    w = _weights(fabric, model)
    assert all(torch.equal(w[k], got["weights"][k]) for k in w)


def _litgpt_run(strategy: str):
    litgpt = pytest.importorskip("litgpt")
    cfg = litgpt.Config(block_size=64, vocab_size=96, padded_vocab_size=96, n_layer=2, n_head=4, n_embd=32,
                        n_query_groups=2, intermediate_size=64, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm",
                        bias=False, parallel_residual=False, rotary_percentage=1.0)
    fabric = _fabric(strategy)
    fabric.seed_everything(0)
    with fabric.init_module(empty_init=False):
        model = litgpt.GPT(cfg)
    model, opt, sched = _setup(fabric, model=model)

    def loss_fn(model, batch):
        ids = batch[0]
        logits = model(ids)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    losses, norms = _loop(fabric, model, opt, sched, _batches(STEPS * ACC), 0, STEPS, loss_fn)
    return losses, norms, _weights(fabric, model), _adam(opt), fabric


def test_litgpt_gpt_is_bitwise_fabric_auto():
    """LitGPT's GPT (its ``Block`` discovered without options) in the LitGPT loop shape: bitwise Fabric's "auto"."""
    ref = _litgpt_run("auto")
    got = _litgpt_run("megatrain")
    assert len(got[4].strategy.engine.blocks) >= 2 + 2  # the two Blocks, the embedding, the head (norm)
    _assert_same(got, ref)


def test_nvme_tier_is_bitwise_fabric_auto(tmp_path):
    """``offload_params``/``offload_optimizer="nvme"`` (``strategy="megatrain_nvme"``'s tier) under Fabric: the same
    numbers as Fabric's "auto"; the weights come back into the module after ``flush`` only through the store."""
    ref = _run("auto")
    strategy = MegaTrainFabricStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                                       host_memory_limit="64MiB")
    fabric = _fabric(strategy)
    model, opt, sched = _setup(fabric)
    losses, norms = _loop(fabric, model, opt, sched, _batches(STEPS * ACC), 0, STEPS)
    assert losses == ref[0] and norms == pytest.approx(ref[1], rel=0, abs=0)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    from safetensors.torch import load_file

    saved = {}
    for f in (tmp_path / "ckpt" / "model").glob("*.safetensors"):
        saved.update(load_file(f))
    bad = [k for k, v in ref[2].items() if k in saved and not torch.equal(saved[k], v)]
    assert not bad and len(saved) >= len(ref[2]) - 1, bad[:5]  # a tied or unsaved key aside


def test_load_raw_and_another_strategys_file_checkpoint(tmp_path):
    """``fabric.load_raw`` of plain ``state_dict()`` files, and ``fabric.load`` of Fabric "auto"'s one-file checkpoint,
    go into the host store: the weights and AdamW state are the saved ones."""
    ref = _run("auto")
    fabric = _fabric("auto")
    model, opt, sched = _setup(fabric)
    _loop(fabric, model, opt, sched, _batches(STEPS * ACC), 0, 2)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fabric.save(tmp_path / "auto.ckpt", {"model": model, "optimizer": opt, "step": 2})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    for how in ("raw", "file"):
        fabric = _fabric("megatrain")
        m, o, _ = _setup(fabric, model=make_model("llama", seed=7))
        if how == "raw":
            fabric.load_raw(tmp_path / "model.pt", m)
            fabric.load_raw(tmp_path / "opt.pt", o)
        else:
            assert fabric.load(tmp_path / "auto.ckpt", {"model": m, "optimizer": o}) == {"step": 2}
        w = _weights(fabric, m)
        assert all(torch.equal(w[k], saved[k]) for k in saved)
        assert len(_adam(o)) == len(ref[3])


def test_fp16_mixed_with_loss_scaling_matches_fabric():
    """``16-mixed`` (a ``GradScaler``: Fabric turns the string into bf16 on the CPU, so the plugin is passed): the
    scale applied in ``fabric.backward``, unscaled once per step by the first of ``clip_gradients`` and ``step``,
    the scaler's schedule, and the same numbers as Fabric's own plugin."""
    from lightning.fabric.plugins.precision import MixedPrecision

    def run(strategy):
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**14))
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1, plugins=[plugin])
        fabric.launch()
        model, opt, sched = _setup(fabric)
        losses, norms = _loop(fabric, model, opt, sched, _batches(6 * ACC), 0, 6)
        scale = (fabric.strategy.precision.scale if isinstance(fabric.strategy, MegaTrainFabricStrategy)
                 else plugin.scaler.get_scale())
        return losses, norms, _weights(fabric, model), _adam(opt), scale

    ref, got = run("auto"), run("megatrain")
    assert got[4] == ref[4]
    _assert_same(got[:4], ref[:4])


def test_bf16_true_first_step_is_fabrics():
    """``precision="bf16-true"``: Fabric's plugin casts the module, buffers included; the strategy's casts the
    buffers (the rotary ``inv_freq``) and streams bf16 copies of the fp32 masters: the first loss is the same."""
    model, ids = make_model("llama"), next(iter(make_data()))[0]
    firsts = []
    for strategy in ("auto", "megatrain"):
        fabric = _fabric(strategy, "bf16-true")
        m = fabric.setup(copy.deepcopy(model))
        firsts.append(m(input_ids=ids, labels=ids).loss.float().item())
        assert m.model.rotary_emb.inv_freq.dtype == torch.bfloat16
        if strategy == "megatrain":
            fabric.strategy.close()
    assert firsts[0] == firsts[1], firsts
