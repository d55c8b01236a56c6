"""Model shapes a sweep of Hugging Face families found giving other numbers than plain Lightning.

Reference: the same module and seed under plain Lightning (``strategy="auto"``). Before the fixes: ``recompute=
"selective"`` reused an attention-score matmul output that the block then divided in place through an alias with its own
version counter (a 4-D ``q @ k.T`` is ``bmm`` + ``_unsafe_view``; Falcon's eager attention does ``scores /= c``):
weights 1-5% off; under ``bf16-mixed`` a block whose input feeds several Linear layers directly (post-LN BERT, the
cross-attention k/v of T5/BART/Whisper) summed those input gradients in bf16 (the engine passed the input as an autograd
leaf, whose cast autocast caches): 3e-4 off after 4 steps on a toy, 2e-2 on T5; OPT's ``lm_head(...).contiguous()``
failed under the default chunked loss; ``mlp_chunk_size`` on a model without a recognised MLP did nothing silently.
T5 under ``bf16-mixed`` (all modes): the decoder layer's cross-attention position bias (``torch.zeros``, no
grad in plain) left the block requiring grad, so the next layer's SDPA took its math kernel (a mask that requires
grad); under ``recompute="block"`` the forward ran under ``no_grad``, where SDPA took another kernel than plain's
(the relative position bias requires grad in plain); ``"selective"`` kept a Linear output the block returned, and a
caller adding the residual into it in place made the recompute fail.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from megatrain_lightning import MegaTrainStrategy
from megatrain_lightning.testing import LM, VOCAB, assert_parity, freeze_key_biases, make_data, rel


class ScoresInPlace(nn.Module):
    """A block computing 4-D attention scores and scaling them in place (``bmm`` + ``_unsafe_view``, then ``/=``)."""

    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2)
        scores /= (d // self.heads) ** 0.5
        a = scores.softmax(-1) @ v
        return x + self.out(a.transpose(1, 2).reshape(b, t, d))


class InputToThreeLinears(nn.Module):
    """A block whose input feeds three Linear layers directly (no norm first), as a post-LN BERT layer does."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.k, self.v, self.ln = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(x + (self.q(x) * self.k(x)).softmax(-1) * self.v(x))


class EndsInLinear(nn.Module):
    """A block whose output is a Linear layer's (a matmul output that ``"selective"`` keeps)."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Toy(pl.LightningModule):
    def __init__(self, layer: type[nn.Module]):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList([layer() for _ in range(3)])
        self.head = nn.Linear(32, VOCAB)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x = self.emb(batch[0])
        for layer in self.layers:
            x = layer(x)
        loss = nn.functional.cross_entropy(self.head(x).flatten(0, 1).float(), batch[0].flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ResidualAddedInPlace(Toy):
    """The caller adds the residual into each block's output in place (``y = layer(x); y += x``)."""

    def training_step(self, batch, batch_idx):
        x = self.emb(batch[0])
        for layer in self.layers:
            y = layer(x)
            y += x
            x = y
        loss = nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch[0].flatten())
        self.losses.append(loss.item())
        return loss


def _fit(module: pl.LightningModule, strategy, precision: str = "32-true", steps: int = 4, data=None):
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, precision=precision, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
               ).fit(module, data or make_data(n=16, batch_size=4))
    return module


def _assert_same(ours: pl.LightningModule, ref: pl.LightningModule, tol: float = 0.0) -> None:
    assert len(ours.losses) == len(ref.losses)
    for a, b in zip(ours.losses, ref.losses):
        assert abs(a - b) <= tol * abs(b), (ours.losses, ref.losses)
    ref_w = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.detach(), ref_w[name].detach()) <= max(tol, 1e-7), name


def test_output_changed_in_place_through_an_alias_is_recomputed():
    ref = _fit(Toy(ScoresInPlace), "auto")
    ours = _fit(Toy(ScoresInPlace), MegaTrainStrategy(recompute="selective", block_classes=[ScoresInPlace]))
    _assert_same(ours, ref)


def test_falcon_eager_attention_under_selective_matches_plain():
    def falcon():
        cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        alibi=False, new_decoder_architecture=False, multi_query=True,
                                        hidden_dropout=0.0, attention_dropout=0.0)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")

    ref = _fit(LM(falcon(), lr=1e-2), "auto")
    ours = _fit(LM(falcon(), lr=1e-2), MegaTrainStrategy(recompute="selective"))
    assert_parity(ours, ref, ours.losses, ref.losses)


@pytest.mark.parametrize("mode", ["block", "none", "selective"])
def test_bf16_input_used_by_several_linears_sums_their_gradients_as_plain(mode):
    ref = _fit(Toy(InputToThreeLinears), "auto", precision="bf16-mixed")
    ours = _fit(Toy(InputToThreeLinears), MegaTrainStrategy(recompute=mode, block_classes=[InputToThreeLinears]),
                precision="bf16-mixed")
    _assert_same(ours, ref)


@pytest.mark.parametrize("mode", ["selective", "none"])
def test_block_output_changed_in_place_by_the_caller(mode):
    """``"selective"`` kept the last Linear's output, which the block returns; the caller's ``y += x`` changed it and
    the recompute raised torch's "Tensor cached during selective activation checkpoint has been mutated"."""
    ref = _fit(ResidualAddedInPlace(EndsInLinear), "auto")
    ours = _fit(ResidualAddedInPlace(EndsInLinear), MegaTrainStrategy(recompute=mode, block_classes=[EndsInLinear]))
    _assert_same(ours, ref)


@pytest.mark.parametrize("mode", ["block", "none", "selective"])
def test_t5_bf16_matches_plain(mode):
    def t5():
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0))

    ref = _fit(LM(t5(), lr=1e-2), "auto", precision="bf16-mixed")
    ours = _fit(LM(t5(), lr=1e-2), MegaTrainStrategy(recompute=mode), precision="bf16-mixed")
    _assert_same(ours, ref)


def test_opt_contiguous_logits_under_the_chunked_loss():
    def opt():
        cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                     dropout=0.0, attention_dropout=0.0)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        freeze_key_biases(model)  # true gradient 0: Adam would train them on rounding noise
        return model

    ref = _fit(LM(opt(), lr=1e-2), "auto")
    ours = _fit(LM(opt(), lr=1e-2), MegaTrainStrategy(loss_chunk_size=5))  # 16 tokens: chunks of 5, 5, 5, 1
    assert_parity(ours, ref, ours.losses, ref.losses)


def test_mlp_chunk_size_without_an_mlp_warns(caplog):
    ids = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="megatrain_lightning"):
        _fit(Toy(InputToThreeLinears), MegaTrainStrategy(mlp_chunk_size=4, block_classes=[InputToThreeLinears]),
             steps=1, data=DataLoader(TensorDataset(ids), batch_size=4))
    msg = [r.getMessage() for r in caplog.records if "mlp_chunk_size=4 has no effect" in r.getMessage()]
    assert len(msg) == 1 and "InputToThreeLinears" in msg[0] and "mlp_chunk_size=None" in msg[0]
