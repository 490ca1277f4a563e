"""Fast tests for the built-in model families and registry (autopar.models)."""

from __future__ import annotations

import pickle
import sys
import textwrap

import pytest
import torch
from torch import nn

from autopar.core.errors import BadInputError
from autopar.models import (
    GPT,
    MLP,
    MODEL_PRESETS,
    GPTConfig,
    Llama,
    LlamaConfig,
    ModelBundle,
    UnknownModelError,
    build_model,
    parse_overrides,
)

TINY = ["tiny-gpt", "tiny-llama", "mlp"]


class WithLoss(nn.Module):
    """Wrap a model and its loss so that export captures forward + loss."""

    def __init__(self, model: nn.Module, loss_fn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(x), y)


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward(name: str) -> None:
    b = build_model(name, device="cpu", global_batch=2)
    assert isinstance(b, ModelBundle) and b.name == name
    out = b.model(*b.example_inputs)
    if name == "mlp":
        assert out.shape == (2, 64) and b.example_targets.dtype == torch.float32
    else:
        cfg = b.config
        assert b.example_inputs[0].dtype == torch.long
        assert b.example_inputs[0].shape == (2, cfg.seq) == b.example_targets.shape
        assert out.shape == (2, cfg.seq, cfg.vocab)
        assert int(b.example_inputs[0].max()) < cfg.vocab
    loss = b.loss_fn(out, b.example_targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in b.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", TINY)
def test_same_seed_same_model_and_data(name: str) -> None:
    a = build_model(name, device="cpu", seed=3)
    b = build_model(name, device="cpu", seed=3)
    c = build_model(name, device="cpu", seed=4)
    for (na, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), na
    assert torch.equal(a.example_inputs[0], b.example_inputs[0])
    assert torch.equal(a.example_targets, b.example_targets)
    assert not torch.equal(a.example_inputs[0], c.example_inputs[0])


def test_init_scheme() -> None:
    b = build_model("tiny-gpt", device="cpu")
    m = b.model
    assert torch.equal(m.ln_f.weight, torch.ones_like(m.ln_f.weight))
    assert torch.equal(m.blocks[0].attn.q_proj.bias, torch.zeros(64))
    assert m.lm_head.bias is None
    std = m.blocks[0].mlp.fc_in.weight.std().item()
    assert 0.015 < std < 0.025


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_causal(name: str) -> None:
    b = build_model(name, device="cpu", global_batch=1, seq=8)
    x = b.example_inputs[0]
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % b.config.vocab
    with torch.no_grad():
        lx, ly = b.model(x), b.model(y)
    torch.testing.assert_close(lx[:, :-1], ly[:, :-1])
    assert not torch.allclose(lx[:, -1], ly[:, -1])


def test_llama_has_no_biases_and_gqa_shapes() -> None:
    b = build_model("tiny-llama", device="cpu")
    assert not any(n.endswith("bias") for n, _ in b.model.named_parameters())
    attn = b.model.blocks[0].attn
    assert attn.k_proj.weight.shape == (2 * 16, 64)  # kv_heads * head_dim
    assert b.model.rope_cos.shape == (32, 16)
    assert "rope_cos" not in b.model.state_dict()  # non-persistent


def test_meta_then_materialize_matches_cpu() -> None:
    cpu = build_model("tiny-llama", device="cpu").model
    meta = build_model("tiny-llama").model
    meta.to_empty(device="cpu")
    meta.reset_buffers()
    for name, buf in cpu.named_buffers():
        torch.testing.assert_close(dict(meta.named_buffers())[name], buf)
    gpt = build_model("tiny-gpt").model.to_empty(device="cpu")
    gpt.reset_buffers()
    assert torch.equal(gpt.pos_ids, torch.arange(32))


def test_tied_embeddings() -> None:
    b = build_model("tiny-gpt", overrides={"tie_embeddings": True}, device="cpu")
    assert b.model.lm_head.weight is b.model.tok_emb.weight
    untied = build_model("tiny-gpt", device="cpu")
    assert untied.num_params() - b.num_params() == 256 * 64


# --------------------------------------------------------------------------- meta presets


@pytest.mark.parametrize(
    "name,expected,tol",
    [("llama3-8b", 8.03e9, 0.01), ("llama3-70b", 70.6e9, 0.01), ("gpt3-175b", 175e9, 0.02)],
)
def test_meta_param_counts(name: str, expected: float, tol: float) -> None:
    b = build_model(name, device="meta")
    assert abs(b.num_params() - expected) / expected < tol
    assert all(p.is_meta for p in b.model.parameters())
    assert all(t.is_meta for t in b.model.buffers())
    assert b.example_inputs[0].is_meta and b.example_targets.is_meta
    assert b.example_inputs[0].shape == (8, b.config.seq)


def test_all_presets_resolve() -> None:
    for name, (family, _) in MODEL_PRESETS.items():
        assert family in {"gpt", "llama", "mlp", "moe"}
        if name != "gpt-megatron":
            assert build_model(name, overrides={"layers": 1}).num_params() > 0


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_export_and_decompose_on_meta(name: str) -> None:
    b = build_model(name, device="meta", global_batch=2, seq=16)
    wrapped = WithLoss(b.model, b.loss_fn)
    ep = torch.export.export(wrapped, (b.example_inputs[0], b.example_targets), strict=False)
    ep = ep.run_decompositions()
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "aten.mm.default" in targets or "aten.addmm.default" in targets
    assert not any("scaled_dot_product" in t or "repeat_interleave" in t for t in targets)


def test_loss_fn_picklable() -> None:
    for name in TINY:
        b = build_model(name)
        assert pickle.loads(pickle.dumps(b.loss_fn)) is b.loss_fn


# --------------------------------------------------------------------------- overrides


def test_parse_overrides_values() -> None:
    got = parse_overrides(" layers=2, hidden=64,bias=false,rope_theta=1e4,norm_eps=0.5, tie_embeddings=True,")
    assert got == {
        "layers": 2,
        "hidden": 64,
        "bias": False,
        "rope_theta": 1e4,
        "norm_eps": 0.5,
        "tie_embeddings": True,
    }
    assert isinstance(got["layers"], int) and isinstance(got["bias"], bool)
    assert parse_overrides(None) == {} and parse_overrides("") == {}


@pytest.mark.parametrize("text,bad", [("layers", "layers"), ("=3", "=3"), ("a=", "a="), ("x=1,x=2", "x=2")])
def test_parse_overrides_errors(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        parse_overrides(text)


def test_a_word_override_is_checked_against_its_field() -> None:
    """A value that is no number or boolean is text: fine for a text field (``mlp``, ``attention``), an error
    naming the item and the expected type for a numeric one."""
    assert parse_overrides("mlp=squared-relu,hidden=abc") == {"mlp": "squared-relu", "hidden": "abc"}
    with pytest.raises(ValueError, match=r"override hidden='abc': expected int"):
        build_model("tiny-llama", overrides=parse_overrides("hidden=abc"))
    with pytest.raises(ValueError, match=r"override mlp=2: expected str"):
        build_model("tiny-llama", overrides=parse_overrides("mlp=2"))
    assert build_model("tiny-gpt", overrides=parse_overrides("attention=eager")).config.attention == "eager"


def test_build_with_overrides() -> None:
    b = build_model("tiny-gpt", overrides=parse_overrides("layers=1,hidden=32,seq=16"))
    assert len(b.model.blocks) == 1 and b.config.hidden == 32
    assert b.example_inputs[0].shape == (8, 16)
    llama = build_model("tiny-llama", overrides={"rope_theta": 10000})
    assert isinstance(llama.config.rope_theta, float)


def test_unknown_override_lists_valid_keys() -> None:
    with pytest.raises(ValueError, match="valid keys are.*kv_heads") as info:
        build_model("tiny-llama", overrides={"nope": 1})
    assert "nope" in str(info.value)


def test_override_type_errors() -> None:
    with pytest.raises(ValueError, match="layers"):
        build_model("tiny-gpt", overrides={"layers": 1.5})
    with pytest.raises(ValueError, match="bias"):
        build_model("tiny-gpt", overrides={"bias": 1})
    with pytest.raises(ValueError, match="divisible"):
        build_model("tiny-gpt", overrides={"heads": 3})


def test_gpt_megatron_needs_dims() -> None:
    with pytest.raises(ValueError, match="layers"):
        build_model("gpt-megatron")
    b = build_model("gpt-megatron", overrides={"layers": 2, "hidden": 128, "heads": 4})
    assert b.config.vocab == 51200 and b.config.seq == 2048


def test_seq_argument() -> None:
    b = build_model("tiny-llama", seq=8, global_batch=3)
    assert b.example_inputs[0].shape == (3, 8)
    with pytest.raises(ValueError, match="seq=64"):
        build_model("tiny-llama", seq=64)


# --------------------------------------------------------------------------- names


def test_unknown_model_error() -> None:
    with pytest.raises(UnknownModelError) as info:
        build_model("foo")
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert msg.startswith("unknown model 'foo': known models are gpt2, ")
    assert "llama3-8b" in msg and msg.endswith("or package.module:factory")


def test_unloadable_factory() -> None:
    with pytest.raises(UnknownModelError, match="cannot load"):
        build_model("no_such_pkg_xyz.mod:make")


def test_custom_factory(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_models_for_test.py").write_text(textwrap.dedent("""
        import torch
        from autopar.models import MLP

        def out_only(out):
            return out.pow(2).mean()

        def four(width=8, global_batch=1):
            m = MLP([width, width])
            x = torch.randn(global_batch, width)
            return m, x, torch.zeros(global_batch, width), torch.nn.functional.mse_loss

        def three():
            return MLP([4, 2]), (torch.randn(2, 4),), out_only
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    b = build_model("my_models_for_test:four", overrides={"width": 6}, global_batch=5, device="cpu")
    assert b.example_inputs[0].shape == (5, 6) and b.example_targets.shape == (5, 6)
    assert torch.isfinite(b.loss_fn(b.model(*b.example_inputs), b.example_targets))
    meta = build_model("my_models_for_test:four")
    assert meta.example_inputs[0].is_meta and all(p.is_meta for p in meta.model.parameters())
    c = build_model("my_models_for_test:three", device="cpu")
    assert c.example_targets is None and c.config is None
    assert c.loss_fn(c.model(*c.example_inputs), None).dim() == 0
    sys.modules.pop("my_models_for_test", None)


def test_a_factory_refuses_overrides_it_has_no_keyword_for_and_names_the_line_that_failed(tmp_path, monkeypatch
                                                                                           ) -> None:
    (tmp_path / "my_failing_models_for_test.py").write_text(textwrap.dedent("""
        import torch
        from autopar.models import MLP

        def checked(width=8, heads=2):
            if width % heads:
                raise ValueError(f"width {width} is not a multiple of heads {heads}")
            return MLP([width, width]), torch.randn(2, width), torch.zeros(2, width), torch.nn.functional.mse_loss
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(BadInputError, match=r"unknown override\(s\) depth for model factory "
                                                r"'my_failing_models_for_test:checked': it takes width, heads$"):
            build_model("my_failing_models_for_test:checked", overrides={"depth": 2})
        with pytest.raises(BadInputError) as info:
            build_model("my_failing_models_for_test:checked", overrides={"width": 6, "heads": 4})
        assert str(info.value).startswith("model factory 'my_failing_models_for_test:checked' failed with width=6, "
                                          "heads=4: ValueError: width 6 is not a multiple of heads 4 (raised at ")
        assert str(info.value).endswith("my_failing_models_for_test.py:7 in checked)")
    finally:
        sys.modules.pop("my_failing_models_for_test", None)


def test_direct_classes() -> None:
    gpt = GPT(GPTConfig(layers=1, hidden=16, heads=2, vocab=10, seq=4, bias=False))
    assert not any(n.endswith("bias") for n, _ in gpt.named_parameters())
    llama = Llama(LlamaConfig(layers=1, hidden=16, heads=4, kv_heads=1, vocab=10, seq=4, ffn_hidden=8))
    idx = torch.randint(0, 10, (2, 4))
    assert gpt(idx).shape == llama(idx).shape == (2, 4, 10)
    mlp = MLP([3, 5, 2])
    assert len(mlp.layers) == 2 and mlp(torch.randn(4, 3)).shape == (4, 2)
