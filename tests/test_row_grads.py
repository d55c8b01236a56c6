"""An embedding's gradient as the rows its tokens read (engine/row_grads.py), against torch's dense gradient."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import megatrain_lightning  # noqa: F401  (registers strategy="megatrain")
from megatrain_lightning.engine.row_grads import RowGrad, to_wire, use_row_grads
from megatrain_lightning.testing import LM, make_data, make_model, reference_train, rel

V, H = 300, 24


def _dense(rows: RowGrad) -> torch.Tensor:
    out = torch.empty(rows.shape)
    rows.copy_to(out)
    return out


def _grads(ids: torch.Tensor, padding_idx: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense gradient [V, H], sparse COO gradient) of one lookup of ``ids`` under the same output gradient."""
    w = torch.randn(V, H, requires_grad=True)
    go = torch.randn(*ids.shape, H)
    (dense,) = torch.autograd.grad(F.embedding(ids, w, padding_idx), w, go)
    (sparse,) = torch.autograd.grad(F.embedding(ids, w, padding_idx, sparse=True), w, go)
    return dense, sparse


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_rows_give_the_dense_gradient_bitwise(padding_idx):
    """Repeated ids (one id 200 times) are summed in token order from zero: the accumulator after a copy, and
    after an add into earlier gradients, is bitwise what the dense gradient gives."""
    torch.manual_seed(0)
    ids = torch.randint(0, V, (4, 256))
    ids[0, :200] = 7
    ids[1, :10] = 0  # padding_idx rows get no gradient
    dense, sparse = _grads(ids, padding_idx)
    rows = RowGrad(to_wire(sparse, torch.float32), (V, H))
    acc = torch.full((V, H), float("nan"))
    rows.copy_to(acc)
    assert torch.equal(acc, dense)
    before = torch.randn(V, H)
    after = before.clone()
    rows.add_to(after)
    assert torch.equal(after, before + dense)


def test_ids_cross_a_bf16_wire_unchanged():
    """With ``grad_dtype="bf16"`` the rows are rounded to bf16 as the dense gradient would be; the int64 ids
    cross as their bytes (4 bf16 elements each) and come back exact."""
    torch.manual_seed(1)
    ids = torch.randint(0, V, (2, 64))
    dense, sparse = _grads(ids)
    values, id_bytes = to_wire(sparse, torch.bfloat16)
    assert id_bytes.dtype == torch.bfloat16 and id_bytes.numel() == 4 * ids.numel()
    rows = RowGrad([values.to(torch.bfloat16), id_bytes.clone()], (V, H))
    assert torch.equal(rows.ids, ids.reshape(-1))
    assert rel(_dense(rows), dense) < 1e-2


def test_rows_only_where_smaller_than_the_table():
    emb = torch.nn.Embedding(V, H)
    assert use_row_grads(emb, 100, torch.float32)          # 100 x (24 + 2) < 300 x 24
    assert not use_row_grads(emb, 277, torch.float32)      # 277 x 26 = 7202 >= 7200
    assert use_row_grads(emb, 276, torch.float32)
    assert not use_row_grads(emb, 260, torch.bfloat16)     # 8-byte ids = 4 bf16 elements: 260 x 28 > 7200
    emb.weight.requires_grad_(False)
    assert not use_row_grads(emb, 1, torch.float32)        # frozen: no gradient at all


def _fit(model, data, steps: int, **strategy):
    trainer = pl.Trainer(strategy="megatrain",
                         accelerator="cpu", devices=1, max_steps=steps, precision="32-true", accumulate_grad_batches=2,
                         enable_checkpointing=False, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    lm = LM(model)
    trainer.fit(lm, data)
    return lm, trainer


@pytest.mark.parametrize("seq", [16, 96])
def test_training_matches_plain_pytorch_with_rows_and_with_the_dense_fallback(seq):
    """A tied llama with accumulation trains bitwise as plain PyTorch whether the embedding's gradient goes as
    rows (16 tokens per sequence) or dense (96: more rows than the table is worth), and the D2H bytes say which."""
    from megatrain_lightning.testing import learnable_data

    model = make_model("llama_tied")
    ref = copy.deepcopy(model)
    data = learnable_data(n=8, seq=seq, batch_size=2)
    lm, trainer = _fit(model, data, 2)
    reference_train(ref, learnable_data(n=8, seq=seq, batch_size=2), 2, accumulate=2)
    for (n, p), q in zip(lm.model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), (n, rel(p.detach(), q.detach()))
    emb = model.model.embed_tokens.weight
    n_params = sum(p.numel() for p in model.parameters())  # tied: the table once
    table_reads = emb.numel()  # the head reads the table again: its dense gradient crosses as well
    tokens = 2 * seq
    rows = tokens * (emb.shape[1] * 4 + 8) < emb.numel() * 4
    per_micro = 4 * (n_params + table_reads) - (4 * emb.numel() - tokens * (emb.shape[1] * 4 + 8) if rows else 0)
    assert rows == (seq == 16)
    assert [h["megatrain/d2h_bytes"] for h in trainer.strategy.engine.history] == [2 * per_micro] * 2


def test_autograd_grad_on_the_embedding_weight_is_dense():
    """``torch.autograd.grad`` on a streamed embedding's weight returns the dense gradient plain PyTorch returns."""
    model = make_model("llama")
    ref = copy.deepcopy(model)
    seen = {}

    class GradOf(LM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            (seen["ours"],) = torch.autograd.grad(loss, [self.model.model.embed_tokens.weight], retain_graph=True)
            return loss

    trainer = pl.Trainer(strategy="megatrain", accelerator="cpu", devices=1, max_steps=1, enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    batch = next(iter(make_data(n=2)))
    trainer.fit(GradOf(model), make_data(n=2))
    ids = batch[0]
    loss = ref(input_ids=ids, labels=ids).loss
    (want,) = torch.autograd.grad(loss, [ref.model.embed_tokens.weight])
    assert seen["ours"].layout == torch.strided and torch.equal(seen["ours"], want)
