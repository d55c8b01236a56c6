"""What PyTorch autograd allows on a plain model works on a streamed one, or fails with a clear
error naming the call. Each test trains the same module with plain Lightning
(``strategy="auto"``) and with ours, in manual optimization, and compares the weights."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

import megatrain_lightning  # noqa: F401
from megatrain_lightning.testing import make_data, make_model, rel

TOL = 1e-5


class Manual(pl.LightningModule):
    """Manual optimization; ``body(self, ids)`` does the forwards and backwards of one step."""

    def __init__(self, model, body):
        super().__init__()
        self.model = model
        self.body = body
        self.automatic_optimization = False
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.body(self, ids)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _run(strategy, body, tmp_path, arch="llama", steps=3, **model_kw):
    lm = Manual(make_model(arch, **model_kw), body)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(lm, make_data(n=16))
    return lm


def _compare(body, tmp_path, **kw):
    ref = _run("auto", body, tmp_path / "ref", **kw)
    got = _run("megatrain", body, tmp_path / "ours", **kw)
    pa, pb = dict(got.named_parameters()), dict(ref.named_parameters())
    for k in pb:
        r = rel(pa[k].detach(), pb[k].detach())
        assert r <= TOL, f"{k}: {r:.2e} relative from plain Lightning"
    assert len(got.seen) == len(ref.seen)
    for a, b in zip(got.seen, ref.seen):
        assert rel(a, b) <= TOL
    return got, ref


def _loss(m, ids, **kw):
    return m.model(input_ids=ids, labels=ids, **kw).loss


def test_retain_graph_then_second_backward(tmp_path):
    def body(m, ids):
        loss = _loss(m, ids)
        m.manual_backward(loss, retain_graph=True)
        m.manual_backward(0.5 * loss)

    _compare(body, tmp_path)


@pytest.mark.parametrize("recompute_every", [1, 2])
def test_retain_graph_with_recompute_segments(tmp_path, recompute_every):
    from megatrain_lightning import MegaTrainStrategy

    def body(m, ids):
        loss = _loss(m, ids)
        m.manual_backward(loss, retain_graph=True)
        m.manual_backward(0.5 * loss, retain_graph=True)
        m.manual_backward(0.25 * loss)

    ref = _run("auto", body, tmp_path / "ref")
    got = _run(MegaTrainStrategy(recompute_every=recompute_every), body, tmp_path / "ours")
    for (k, a), b in zip(got.named_parameters(), ref.parameters()):
        assert rel(a.detach(), b.detach()) <= TOL, k


def test_second_backward_without_retain_graph_fails_like_pytorch(tmp_path):
    def body(m, ids):
        loss = _loss(m, ids)
        m.manual_backward(loss)
        m.manual_backward(loss)

    for strategy in ("auto", "megatrain"):
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            _run(strategy, body, tmp_path / strategy, steps=1)


def test_two_forwards_then_one_backward(tmp_path):
    def body(m, ids):
        a = _loss(m, ids)
        b = _loss(m, ids.flip(1))
        m.manual_backward(a + 0.5 * b)

    _compare(body, tmp_path)


@pytest.mark.parametrize("recompute_every", [1, 2])
def test_two_forwards_backward_in_reverse_order(tmp_path, recompute_every):
    from megatrain_lightning import MegaTrainStrategy

    def body(m, ids):
        a = _loss(m, ids)
        b = _loss(m, ids.flip(1))
        m.manual_backward(b)
        m.manual_backward(a)

    ref = _run("auto", body, tmp_path / "ref")
    got = _run(MegaTrainStrategy(recompute_every=recompute_every), body, tmp_path / "ours")
    for (k, a), b in zip(got.named_parameters(), ref.parameters()):
        assert rel(a.detach(), b.detach()) <= TOL, k


def test_loss_that_uses_only_some_blocks(tmp_path):
    """A loss on the hidden states after layer 1: layers 2.., the final norm and the LM head get no
    gradient (AdamW skips them, as in plain PyTorch)."""
    def body(m, ids):
        out = m.model(input_ids=ids, output_hidden_states=True)
        loss = out.hidden_states[2].pow(2).mean()
        m.manual_backward(loss)

    got, ref = _compare(body, tmp_path)
    assert torch.equal(got.model.lm_head.weight, ref.model.lm_head.weight)  # untouched in both


def test_autograd_grad_wrt_inputs_does_not_touch_parameter_grads(tmp_path):
    """torch.autograd.grad(loss, inputs_embeds) returns the input gradient and accumulates nothing
    into the parameters: the step after it only sees the gradients of the real backward."""
    def body(m, ids):
        emb = m.model.get_input_embeddings()(ids).detach().requires_grad_(True)
        loss = m.model(inputs_embeds=emb, labels=ids).loss
        (g,) = torch.autograd.grad(loss, emb)
        m.seen.append(g.detach().clone())
        m.manual_backward(_loss(m, ids))

    _compare(body, tmp_path)


def test_backward_with_inputs_only_fills_those(tmp_path):
    def body(m, ids):
        emb = m.model.get_input_embeddings()(ids).detach().requires_grad_(True)
        loss = m.model(inputs_embeds=emb, labels=ids).loss
        loss.backward(inputs=[emb])
        m.seen.append(emb.grad.detach().clone())
        m.manual_backward(_loss(m, ids))

    _compare(body, tmp_path)


def test_autograd_grad_wrt_parameters(tmp_path):
    """torch.autograd.grad(loss, params) returns every parameter's gradient (plain PyTorch's
    values) and leaves the accumulators alone."""
    def body(m, ids):
        params = [p for p in m.parameters() if p.requires_grad]
        grads = torch.autograd.grad(_loss(m, ids), params, allow_unused=True)
        m.seen.extend(torch.zeros(()) if g is None else g.detach().clone() for g in grads)
        m.manual_backward(_loss(m, ids))

    _compare(body, tmp_path)


def test_create_graph_is_refused_with_a_clear_error(tmp_path):
    def body(m, ids):
        loss = _loss(m, ids)
        m.manual_backward(loss, create_graph=True)

    with pytest.raises(RuntimeError, match="create_graph=True"):
        _run("megatrain", body, tmp_path, steps=1)


def test_two_forwards_one_loss_with_update_in_backward(tmp_path):
    """Automatic optimization, NVMe tier (AdamW updates applied during backward by default): a
    training_step that sums the losses of two forwards must not update a block before the gradients
    of both forwards reached it (the second forward shares the step: deferred schedule)."""
    from megatrain_lightning import MegaTrainStrategy
    from megatrain_lightning.testing import LM

    class TwoForwards(LM):
        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return _loss(self, ids) + 0.5 * _loss(self, ids.flip(1))

    def run(strategy, root):
        lm = TwoForwards(make_model("llama"))
        pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=3, enable_checkpointing=False, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root)).fit(lm, make_data(n=16))
        return lm

    (tmp_path / "store").mkdir()
    ours = MegaTrainStrategy(offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path / "store"),
                             host_memory_limit="256MiB")
    got, ref = run(ours, tmp_path / "ours"), run("auto", tmp_path / "ref")
    assert ours.engine.optimizer.updates_in_backward == 0  # the deferred schedule ran
    for (k, a), b in zip(got.named_parameters(), ref.parameters()):
        assert rel(a.detach(), b.detach()) <= TOL, k


def test_backward_with_inputs_listing_parameters_updates_only_those(tmp_path):
    """backward(inputs=[some parameters]) accumulates their gradients only (into the host
    accumulators, which are their .grad for the step); the others get no update."""
    def body(m, ids):
        layer = m.model.model.layers[1]
        listed = [layer.mlp.up_proj.weight, m.model.lm_head.weight, m.model.model.embed_tokens.weight]
        _loss(m, ids).backward(inputs=listed)

    got, ref = _compare(body, tmp_path)
    assert torch.equal(got.model.model.layers[0].mlp.up_proj.weight, ref.model.model.layers[0].mlp.up_proj.weight)


def _grad_norms(m) -> torch.Tensor:
    """Every parameter's gradient norm (0 for ``None``), stacked: what a user logs between backward and step."""
    return torch.stack([p.grad.norm() if p.grad is not None else torch.zeros(()) for p in m.parameters()])


def test_param_grad_between_manual_backward_and_step(tmp_path):
    """Manual optimization: ``param.grad`` holds the accumulated gradients after each ``manual_backward`` (it was
    ``None`` until ``opt.step()``), and edits made there (in place, through ``.data``, or a new tensor) are what
    the step uses, as in plain Lightning; ``clip_gradients`` clips the edited gradients."""
    def body(m, ids):
        m.manual_backward(_loss(m, ids))
        m.seen.append(_grad_norms(m))
        m.manual_backward(0.5 * _loss(m, ids.flip(1)))
        m.seen.append(_grad_norms(m))
        for i, p in enumerate(m.parameters()):
            if p.grad is not None:
                if i % 3 == 0:
                    p.grad.mul_(0.5)
                elif i % 3 == 1:
                    p.grad.data.add_(1e-3)
                else:
                    p.grad = p.grad * 2.0
        m.seen.append(_grad_norms(m))
        m.clip_gradients(m.optimizers(), gradient_clip_val=0.05, gradient_clip_algorithm="norm")

    got, _ = _compare(body, tmp_path)
    assert len(got.seen) == 9 and all(bool((s > 0).any()) for s in got.seen)
    assert all(p.grad is None for p in got.parameters())  # zero_grad(set_to_none=True) then step: as plain


def test_zero_grad_after_reading_grads_drops_them(tmp_path):
    """``self.optimizers().zero_grad()`` between a backward and the next: the gradients are gone (``None``) and the
    step uses only the later backward's, as in plain PyTorch. Before, Lightning's optimizer wrapper ran the
    optimizer class's ``zero_grad``, which the engine never saw: the step used both backwards' gradients."""
    def body(m, ids):
        m.manual_backward(_loss(m, ids))
        m.seen.append(_grad_norms(m))
        m.optimizers().zero_grad()
        m.seen.append(torch.tensor([float(p.grad is None) for p in m.parameters()]))
        m.manual_backward(_loss(m, ids.flip(1)))
        m.seen.append(_grad_norms(m))

    _compare(body, tmp_path)
