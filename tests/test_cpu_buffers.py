"""The CPU transport's reused compute buffers (engine/cpu_buffers.py): a buffer is handed out again only
once nothing refers to its memory, and the pool stays at the compute window's size over a run."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import torch

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.blocks import discover_blocks
from megatrain_lightning.engine.cpu_buffers import BufferPool
from megatrain_lightning.testing import LM, assert_parity, make_data, make_model, reference_train


def test_a_buffer_is_reused_only_when_nothing_refers_to_it():
    pool = BufferPool()
    a = pool.take(1000, torch.float32)
    ptr = a.data_ptr()
    del a
    b = pool.take(1000, torch.float32)
    assert b.data_ptr() == ptr                     # free again: the same memory
    view = b[10:20]                                # a view of it still alive
    del b
    c = pool.take(1000, torch.float32)
    assert c.data_ptr() != ptr                     # not handed out while a view reads it
    del view
    w = torch.ones(1000, requires_grad=True)
    d = pool.take(1000, torch.float32)             # the buffer freed by `del view`
    assert d.data_ptr() == ptr
    d.copy_(torch.arange(1000.0))
    loss = (w * d).sum()                           # autograd saves d for w's gradient
    del d
    e = pool.take(1000, torch.float32)
    assert e.data_ptr() not in (ptr, c.data_ptr())
    e.fill_(-1.0)
    loss.backward()
    assert torch.equal(w.grad, torch.arange(1000.0))  # the saved buffer was not overwritten
    assert pool.take(1000, torch.bfloat16).dtype == torch.bfloat16  # another dtype: its own buffer
    assert pool.nbytes == 3 * 4000 + 2000


def test_copying_cpu_device_reuses_its_buffers_with_the_same_numbers():
    """cpu_zero_copy=False: the same numbers as plain PyTorch, and the pool stays at the compute window's
    size (each fetch reuses a buffer freed earlier; 4 steps fetch 40 blocks)."""
    model = make_model("llama_tied")
    ref = copy.deepcopy(model)
    sizes = []

    class Pool(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            sizes.append(trainer.strategy.engine.transport.pool.nbytes)

    lm = LM(model)
    trainer = pl.Trainer(strategy=MegaTrainStrategy(cpu_zero_copy=False), accelerator="cpu", devices=1, max_steps=4,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Pool()])
    trainer.fit(lm, make_data(n=8))
    ref_losses = reference_train(ref, make_data(n=8), 4)
    assert_parity(lm.model, ref, lm.losses, ref_losses)
    assert sizes[0] > 0
    # the compute window: the block computing and those in flight (lookahead=1: within 2 largest blocks),
    # plus small ones; not a buffer per fetch
    largest = max(sum(r.param.numel() for r in b.params) * 4 for b in discover_blocks(model))
    assert sizes[-1] <= 3 * largest, (sizes, largest)
