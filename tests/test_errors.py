"""Bad input gets a clear error, naming the fix, before any training step runs."""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl
import pytest
import torch
import transformers
from torch import nn

import megatrain_lightning  # noqa: F401
from megatrain_lightning import (BlockDiscoveryError, MegaTrainPrecision, MegaTrainStrategy,
                                 UnsupportedOptimizerError, UnsupportedPrecisionError, discover_blocks)
from megatrain_lightning.testing import LM, make_data, make_model


def _fit(lm, **kw):
    base = dict(strategy="megatrain", accelerator="cpu", max_steps=2, enable_checkpointing=False, logger=False,
                enable_progress_bar=False, enable_model_summary=False)
    base.update(kw)
    pl.Trainer(**base).fit(lm, make_data(n=4))


class _Counting(LM):
    steps_run = 0

    def training_step(self, batch, batch_idx):
        type(self).steps_run += 1
        return super().training_step(batch, batch_idx)


class PlainNet(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.b(self.a(batch[0].float()[:, :4])).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_model_without_blocks():
    with pytest.raises(BlockDiscoveryError, match="block_classes"):
        _fit(PlainNet())


def test_override_makes_a_plain_module_streamable():
    blocks = discover_blocks(PlainNet(), block_names=["a", "b"])
    assert [b.name for b in blocks] == ["a", "b"]
    with pytest.raises(BlockDiscoveryError, match="matched"):
        discover_blocks(PlainNet(), block_classes=["NoSuchLayer"])


def test_unsupported_optimizer_class():
    class LBFGSLM(_Counting):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    LBFGSLM.steps_run = 0
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS.*closure"):
        _fit(LBFGSLM(make_model("llama")))
    assert LBFGSLM.steps_run == 0


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_unsupported_adamw_flags(flag):
    class FlagLM(_Counting):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), **{flag: True})

    FlagLM.steps_run = 0
    with pytest.raises(UnsupportedOptimizerError, match=f"AdamW.*{flag}=True"):
        _fit(FlagLM(make_model("llama")))
    assert FlagLM.steps_run == 0


def test_two_optimizers():
    class TwoLM(_Counting):
        def __init__(self, m):
            super().__init__(m)
            self.automatic_optimization = False

        def configure_optimizers(self):
            ps = list(self.parameters())
            return [torch.optim.AdamW(ps[:2]), torch.optim.AdamW(ps[2:])]

    TwoLM.steps_run = 0
    with pytest.raises(UnsupportedOptimizerError, match="exactly one optimizer"):
        _fit(TwoLM(make_model("llama")))
    assert TwoLM.steps_run == 0


@pytest.mark.parametrize("precision", ["16-true", "64-true", "transformer-engine"])
def test_unsupported_precision(precision):
    if precision != "transformer-engine":  # Lightning itself refuses it first when TE is not installed
        with pytest.raises(UnsupportedPrecisionError, match="32-true"):
            pl.Trainer(strategy="megatrain", accelerator="cpu", precision=precision)
    with pytest.raises(UnsupportedPrecisionError, match="supports precision"):
        MegaTrainPrecision(precision)


def test_unsupported_grad_dtype():
    with pytest.raises(UnsupportedPrecisionError, match="grad_dtype"):
        MegaTrainPrecision("bf16-mixed", grad_dtype="fp8")


def test_parameter_on_root_module():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2))
            self.layer = nn.Linear(2, 2)

    with pytest.raises(BlockDiscoveryError, match="owns parameters directly"):
        discover_blocks(Root(), block_names=["layer"])


def test_parameter_on_lightning_module_names_only_its_own_and_says_how_to_wrap():
    """Prompt tuning's ``self.prompt = nn.Parameter(...)`` on the LightningModule: the error lists the directly
    owned parameters (also those of an ``nn.ParameterList`` / ``nn.ParameterDict`` child), not every parameter
    of the model (before the fix: all of them, so users were told to move their whole model), and says how to
    wrap them."""
    lm = LM(make_model("llama"))
    lm.prompt = nn.Parameter(torch.zeros(3, 32))
    lm.extra = nn.ParameterList([nn.Parameter(torch.zeros(2))])
    lm.named = nn.ParameterDict({"bias": nn.Parameter(torch.zeros(2))})
    with pytest.raises(BlockDiscoveryError) as err:
        discover_blocks(lm)
    msg = str(err.value)
    assert "owns parameters directly (['prompt', 'extra.0', 'named.bias'])" in msg
    assert "embed_tokens" not in msg
    assert "small nn.Module whose forward returns it" in msg and "self.prompt()" in msg


def test_block_names_example_comes_from_the_module_paths():
    """``block_names="model.layers.*"`` on a LightningModule holding the HF model as ``self.model``: paths are
    relative to the LightningModule, and the example the error ends with is the real one (before the fix it
    was the rejected ``'model.layers.*'``)."""
    with pytest.raises(BlockDiscoveryError) as err:
        discover_blocks(LM(make_model("llama")), block_names="model.layers.*")
    msg = str(err.value)
    assert "['model.layers.*'] match no module path" in msg
    assert msg.endswith("relative to the module given to the strategy (the LightningModule), e.g. 'model.model.layers.*'.")
    assert discover_blocks(LM(make_model("llama")), block_names="model.model.layers.*")  # the example works
    # no _no_split_modules and no names: the suggested pattern is a path of this module too
    with pytest.raises(BlockDiscoveryError, match=r"block_names=\['net.layers.\*'\]"):
        discover_blocks(_M2())


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, h):
        return self.fc(h)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.pos = nn.Parameter(torch.zeros(4))


class _M2(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _Net()


class _Shared(pl.LightningModule):
    """ALBERT-style: one layer reused at every depth (a list of one module: no repeated path to suggest)."""

    def __init__(self):
        super().__init__()
        self.groups = nn.ModuleList([_Layer()])


def test_a_model_without_repeated_paths_gets_no_made_up_pattern():
    """With no repeated path (ALBERT shares one layer) the error suggests the layer class only, not a
    ``block_names=['model.layers.*']`` path the model does not have."""
    with pytest.raises(BlockDiscoveryError) as err:
        discover_blocks(_Shared())
    msg = str(err.value)
    assert "block_classes=[YourLayerClass])` (the class of the layer the model repeats or reuses) to name" in msg
    assert "model.layers" not in msg and "groups.* (_Layer)" in msg
    assert discover_blocks(_Shared(), block_classes=["_Layer"])


def test_unmatched_block_name_lists_the_module_paths():
    """A pattern that matches nothing is an error that shows the paths there are to match."""
    with pytest.raises(BlockDiscoveryError) as err:
        discover_blocks(_M2(), block_names=["net.layer.*"])  # typo: layers
    msg = str(err.value)
    assert "['net.layer.*'] match no module path of _M2" in msg
    for path in ("net (_Net)", "net.layers (ModuleList)", "net.layers.* (_Layer)", "net.layers.*.fc (Linear)"):
        assert path in msg, path
    # one pattern right, one wrong: still an error naming the wrong one
    with pytest.raises(BlockDiscoveryError, match=r"\['net.head'\] match no module path"):
        discover_blocks(_M2(), block_names=["net.layers.*", "net.head"])
    # a class that matches nothing lists the paths with their classes too
    with pytest.raises(BlockDiscoveryError, match=r"No module of _M2 matched.*net.layers.\* \(_Layer\)"):
        discover_blocks(_M2(), block_classes=["Layer"])
    # the right names work although the container owns a parameter (it gets a block of its own)
    blocks = discover_blocks(_M2(), block_names=["net.layers.*"])
    assert [(b.name, [r.fqn for r in b.params]) for b in blocks] == [
        ("net", ["net.pos"]), ("net.layers.0", ["net.layers.0.fc.weight", "net.layers.0.fc.bias"]),
        ("net.layers.1", ["net.layers.1.fc.weight", "net.layers.1.fc.bias"])]


@pytest.mark.parametrize("bad", [dict(lookahead=-1), dict(lookahead="2"), dict(lookahead=1.5), dict(recompute_every=0),
                                 dict(recompute_every="3"), dict(checkpoint_every=0)])
def test_bad_lookahead_or_recompute_every_is_refused_when_the_strategy_is_built(bad):
    """Before any Trainer or model exists, with the option's name and Hydra key."""
    key = next(iter(bad)).replace("checkpoint_every", "recompute_every")
    with pytest.warns(DeprecationWarning) if "checkpoint_every" in bad else contextlib.nullcontext():
        with pytest.raises(ValueError, match=rf"{key} must be an int .*strategy\.{key}"):
            MegaTrainStrategy(**bad)


def test_switches_and_options_without_effect(tmp_path):
    """A string for an on/off switch ("false" is truthy) is refused; options that only act with another one
    warn that they do nothing alone; NVMe I/O settings are checked even with the tier off."""
    with pytest.raises(ValueError, match=r"log_stats must be True or False, got 'false'.*strategy\.log_stats"):
        MegaTrainStrategy(log_stats="false")
    with pytest.raises(ValueError, match="pin_memory must be True, False or None"):
        MegaTrainStrategy(pin_memory="yes")
    with pytest.warns(UserWarning, match="nvme_path given but nothing is offloaded to NVMe"):
        MegaTrainStrategy(nvme_path=str(tmp_path))
    with pytest.warns(UserWarning, match="activation_memory_limit has no effect with recompute='block'"):
        MegaTrainStrategy(activation_memory_limit="1GiB")
    with pytest.raises(ValueError, match="nvme_io_threads must be an integer >= 1"):
        MegaTrainStrategy(nvme_io_threads=0)


def test_one_block_class_or_name_given_as_a_string():
    """A single class name or pattern (a natural Hydra override) is one entry, not a list of characters."""
    model = make_model("llama")
    by_list = [b.name for b in discover_blocks(model, block_names=["model.layers.*"])]
    assert [b.name for b in discover_blocks(model, block_names="model.layers.*")] == by_list
    assert [b.name for b in discover_blocks(model, block_classes="LlamaDecoderLayer")] == by_list
    assert [b.name for b in discover_blocks(model, block_classes=type(model.model.layers[0]))] == by_list


class TwoLayerNet(nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.inplace = inplace

    def forward(self, x):
        h1 = self.layers[0](x)
        h2 = self.layers[1](h1)
        if self.inplace:
            h1.mul_(2.0)  # modifies the saved input of layers[1] after its forward
        return (h2 + h1).square().mean()


@pytest.mark.parametrize("inplace", [False, True])
def test_inplace_change_of_a_saved_input_is_caught(inplace):
    from megatrain_lightning.engine.streaming import StreamingEngine

    torch.manual_seed(0)
    net = TwoLayerNet(inplace)
    ref = TwoLayerNet(inplace)
    ref.load_state_dict(net.state_dict())
    eng = StreamingEngine(net, torch.device("cpu"), block_names=["layers.*"])
    eng.install()
    x = torch.randn(4, 8, requires_grad=True)
    loss = net(x)
    if inplace:
        with pytest.raises(RuntimeError, match="modified in place"):
            loss.backward()
    else:
        loss.backward()
        eng.attach_grads()
        ref(x.detach()).backward()
        for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=n)
    eng.close()


@pytest.mark.parametrize("how", ["wrapped", "in_place", "one_block"])
def test_compiled_submodule_is_refused_before_the_first_step(how):
    """Plain Lightning trains a LightningModule holding a torch.compile'd model; with strategy='megatrain' Dynamo
    traced into the engine's block forward and failed in the first step with an internal NameError (whole model),
    or fell back to eager after its recompile limit (one block). Now: one error naming the submodule, no step run."""
    def lm_for() -> _Counting:
        model = make_model("llama")
        if how == "in_place":
            model.compile(backend="eager")
        if how == "one_block":
            model.model.layers[1].compile(backend="eager")
        lm = _Counting(model)
        if how == "wrapped":
            lm.model = torch.compile(model, backend="eager")
        return lm

    _Counting.steps_run = 0
    _fit(lm_for(), strategy="auto")  # the reference: Lightning itself accepts it
    assert _Counting.steps_run == 2
    _Counting.steps_run = 0
    where = {"wrapped": "model", "in_place": "model", "one_block": "model.model.layers.1"}[how]
    with pytest.raises(RuntimeError, match=rf"submodule {where} \(.*\) is compiled .*torch.compile\(model\)"):
        _fit(lm_for())
    assert _Counting.steps_run == 0


def _gemma(model_type: str, shared: int) -> transformers.PreTrainedModel:
    """A tiny Gemma 3n / Gemma 4 text model (3 layers); ``shared``: its last layers attend over the keys and values
    an earlier layer stored in ``shared_kv_states`` (``num_kv_shared_layers``)."""
    gemma3n = dict(laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 3, intermediate_size=[64] * 3)
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_kv_shared_layers=shared,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, tie_word_embeddings=False,
        **(gemma3n if model_type == "gemma3n_text" else dict(intermediate_size=64)))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text"])
def test_keys_and_values_shared_across_layers_are_refused_in_the_first_forward(model_type):
    """Gemma 3n / Gemma 4 with ``num_kv_shared_layers=1``: layer 0 stores its keys and values in the
    ``shared_kv_states`` dict and layer 2 attends over them. A streamed block connects only its return values to
    autograd, so layer 0's k/v projections lost layer 2's gradient (12% relative weight error, no error, before
    engine/side_outputs.py). Now the read raises, before any update; Gemma 4 storing them with no layer reading
    them (``num_kv_shared_layers=0``) still trains bitwise as plain Lightning."""
    _Counting.steps_run = 0
    with pytest.raises(BlockDiscoveryError, match=r"read a tensor that a Gemma.*TextDecoderLayer block stored into its "
                                                  r"argument `shared_kv_states`.*num_kv_shared_layers=0"):
        _fit(_Counting(_gemma(model_type, shared=1)))
    assert _Counting.steps_run == 1  # raised in the first training_step, before any optimizer step
    if model_type == "gemma4_text":
        ours, ref = LM(_gemma(model_type, shared=0)), LM(_gemma(model_type, shared=0))
        for lm, strategy in ((ours, "megatrain"), (ref, "auto")):
            torch.manual_seed(0)
            _fit(lm, strategy=strategy)
        assert ours.losses == ref.losses
        assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))


def test_sixteen_bit_warning_tells_frozen_from_trained_parameters(caplog):
    """A QLoRA-style bf16 base (frozen) under fp32 trainable weights: the warning said the frozen weights were
    "trained in fp32" where plain Lightning "would update" them; neither side updates them (probe)."""
    import logging

    from megatrain_lightning.module_checks import warn_low_precision
    from megatrain_lightning.testing import make_model

    model = make_model("llama").to(torch.bfloat16)
    model.model.layers[0].mlp.up_proj.weight.data = model.model.layers[0].mlp.up_proj.weight.data.float()
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("model.layers.1."))
    with caplog.at_level(logging.WARNING):
        warn_low_precision(model)
    frozen = [r.getMessage() for r in caplog.records if "frozen" in r.getMessage()]
    trained = [r.getMessage() for r in caplog.records if " trainable " in r.getMessage()]
    assert len(frozen) == 1 and "computed with in fp32 instead of bfloat16" in frozen[0] and "updat" not in frozen[0]
    assert len(trained) == 1 and "they are trained in fp32" in trained[0]


def test_fit_without_an_optimizer_is_refused_clearly():
    """``configure_optimizers`` returning ``None``: plain Lightning fits with its stand-in optimizer (nothing is
    updated); megatrain, which updates the weights on the host with the returned optimizer, refuses it by name."""
    import lightning.pytorch as pl

    from megatrain_lightning import MegaTrainStrategy, UnsupportedOptimizerError
    from megatrain_lightning.testing import LM, make_data, make_model

    class NoOptimizer(LM):
        def configure_optimizers(self):
            return None

    def trainer(strategy):
        return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    with pytest.warns(UserWarning, match="configure_optimizers` returned `None`, this fit will run with no optimizer"):
        trainer("auto").fit(NoOptimizer(make_model("llama")), make_data(8))
    with pytest.raises(UnsupportedOptimizerError, match="configure_optimizers returned no optimizer .* return one"):
        trainer(MegaTrainStrategy()).fit(NoOptimizer(make_model("llama")), make_data(8))
