"""Tests for pipeline.model: shapes, parameter parity with timm, resampling, I/O, conversion."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.model import (
    PRESETS,
    VisionTransformer,
    ViTConfig,
    attention_maps,
    build_model,
    build_vit,
    convert_state_dict,
    load_model,
    resample_patch_embed,
    resample_pos_embed,
    save_model,
)

torch.manual_seed(0)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def nano(**kw) -> VisionTransformer:
    kw = {"patch_size": 4, "image_size": 16, "num_classes": 10, **kw}
    return build_vit("nano", **kw)


# ----------------------------------------------------------------------------- config
def test_config_normalises_and_roundtrips_json():
    cfg = ViTConfig(image_size=[32, 48], patch_size=8, embed_dim=64, depth=2, num_heads=4)
    assert cfg.image_size == (32, 48) and cfg.patch_size == (8, 8)
    assert cfg.grid_size == (4, 6) and cfg.num_patches == 24
    again = ViTConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(image_size=30, patch_size=16), "image_size"),
        (dict(image_size=(32, 30), patch_size=16), "divisible"),
        (dict(embed_dim=65), "num_heads"),
        (dict(pool="max"), "pool"),
        (dict(depth=0), "depth"),
        (dict(patch_size=(0, 4)), "patch_size"),
        (dict(drop_path_rate=1.5), "drop_path_rate"),
        (dict(num_classes=-1), "num_classes"),
    ],
)
def test_config_rejects_bad_values(kw, match):
    base = dict(image_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4)
    with pytest.raises(ValueError, match=match):
        ViTConfig(**{**base, **kw})


def test_build_rejects_unknown_names():
    with pytest.raises(ValueError, match="valid presets"):
        build_vit("gigantic", patch_size=16, image_size=224, num_classes=10)
    with pytest.raises(ValueError, match="valid ViTConfig fields"):
        nano(dropout=0.1)
    assert nano(depth=2, embed_dim=32).config.depth == 2


def test_build_model_reads_the_params_model_section():
    from pipeline.config import ModelConfig

    section = ModelConfig(preset="nano", patch_size=4, pool="mean", drop_path_rate=0.1, depth=2)
    model = build_model(section, image_size=16, num_classes=3)
    assert model.config == nano(pool="mean", drop_path_rate=0.1, depth=2, num_classes=3).config
    torch.manual_seed(1)
    drawn = build_model(dataclasses.replace(section, weight_init="mimetic"), image_size=16, num_classes=3)
    torch.manual_seed(1)
    same = nano(pool="mean", drop_path_rate=0.1, depth=2, num_classes=3, weight_init="mimetic")
    torch.testing.assert_close(drawn.state_dict(), same.state_dict(), rtol=0, atol=0)
    assert build_model(section, image_size=16, num_classes=3, patch_size=8).config.patch_size == (8, 8)


# ----------------------------------------------------------------------------- shapes / params
@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_forward_shapes(pool):
    model = nano(pool=pool).eval()
    x = torch.randn(3, 3, 16, 16)
    tokens = model.forward_features(x)
    assert tokens.shape == (3, 1 + 16, 64)
    assert model.forward_head(tokens).shape == (3, 10)
    assert model(x).shape == (3, 10)
    assert model.forward_head(tokens, pre_logits=True).shape == (3, 64)


def test_cls_forward_shortcut_matches_full_path():
    """forward() computes only [CLS] in the last block; logits and grads must equal the full path."""
    model = _perturb(nano(qkv_bias=False)).train()  # train mode: no dropout configured, so deterministic
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([1, 2, 3, 4])
    F.cross_entropy(model(x), y).backward()
    fast = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model.forward_head(model.forward_features(x))
    F.cross_entropy(logits, y).backward()
    torch.testing.assert_close(model(x), logits, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(fast[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_inference_in_place_path_matches_autograd_path(pool):
    """Without grad, GELU and the MLP residual run in place: same outputs, caller's tensors untouched."""
    model = _perturb(nano(pool=pool)).eval()
    x = torch.randn(4, 3, 16, 16)
    with_grad = model(x)
    tokens = torch.randn(4, 17, model.config.embed_dim)
    before = tokens.clone()
    with torch.inference_mode():
        torch.testing.assert_close(model(x), with_grad.detach(), rtol=0, atol=0)
        block_out = model.blocks[0](tokens)
        mlp_out = model.blocks[0].mlp(tokens)
    assert torch.equal(tokens, before)  # inputs are never overwritten
    torch.testing.assert_close(block_out, model.blocks[0](tokens).detach(), rtol=0, atol=0)
    torch.testing.assert_close(mlp_out, model.blocks[0].mlp(tokens).detach(), rtol=0, atol=0)


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_torchscript_export_runs_with_grad(pool, tmp_path):
    """The export traces under no_grad; the in-place inference ops must not be baked into the graph, so the
    exported model still backpropagates (saliency, fine-tuning it) and gives the eager model's numbers."""
    from pipeline.exporter import export_torchscript
    from pipeline.predict import load_torchscript

    model = _perturb(nano(pool=pool))
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        export_torchscript(model, x, tmp_path / "model.torchscript.pt")
        expected = model(x)
    traced = load_torchscript(tmp_path / "model.torchscript.pt")
    xt, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = traced(xt)
    out.sum().backward()
    model(xe).sum().backward()
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xt.grad, xe.grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), expected, rtol=1e-5, atol=1e-5)


def test_mean_pool_averages_patch_tokens_only():
    model = nano(pool="mean").eval()
    tokens = torch.randn(2, 17, 64)
    expected = model.head(tokens[:, 1:].mean(1))
    torch.testing.assert_close(model.forward_head(tokens), expected)
    assert not torch.allclose(model.forward_head(tokens), model.head(tokens.mean(1)))


def test_headless_model_returns_features():
    model = nano(num_classes=0).eval()
    assert isinstance(model.head, torch.nn.Identity)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 64)


def test_vit_b16_param_count():
    with torch.device("meta"):
        model = build_vit("base", patch_size=16, image_size=224, num_classes=1000)
    assert n_params(model) == 86_567_656


@pytest.mark.parametrize("preset", ["tiny", "small", "large", "huge"])
def test_param_count_and_names_match_timm(preset):
    import timm.models.vision_transformer as timm_vit
    p = PRESETS[preset]
    with torch.device("meta"):  # shapes only: no memory, no init cost
        ours = build_vit(preset, patch_size=16, image_size=224, num_classes=1000)
        ref = timm_vit.VisionTransformer(
            img_size=224, patch_size=16, num_classes=1000,
            embed_dim=p["embed_dim"], depth=p["depth"], num_heads=p["num_heads"], mlp_ratio=p["mlp_ratio"],
        )
    assert n_params(ours) == n_params(ref)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


def test_wrong_input_size_raises_with_hint():
    model = nano()
    with pytest.raises(ValueError, match=r"\(32, 32\).*\(16, 16\).*set_input_size.*dynamic_img_size"):
        model(torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="expected images"):
        model(torch.randn(1, 1, 16, 16))


# ----------------------------------------------------------------------------- resampling
def test_resample_pos_embed_identity_on_same_grid():
    pos = torch.randn(1, 1 + 6 * 4, 8)
    out = resample_pos_embed(pos, (6, 4), old_grid=(6, 4))
    assert torch.equal(out, pos)
    square = torch.randn(2, 17, 8)
    assert torch.equal(resample_pos_embed(square, 4), square)  # old_grid defaults to sqrt(16) = 4


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic", "area"])
def test_resample_pos_embed_keeps_cls_and_resizes_grid(mode):
    pos = torch.randn(1, 1 + 4 * 6, 8, dtype=torch.bfloat16)
    out = resample_pos_embed(pos, (8, 3), old_grid=(4, 6), mode=mode)
    assert out.shape == (1, 1 + 8 * 3, 8) and out.dtype == torch.bfloat16
    assert torch.equal(out[:, :1], pos[:, :1])


def test_resample_pos_embed_errors():
    with pytest.raises(ValueError, match="mode"):
        resample_pos_embed(torch.randn(1, 17, 8), 8, mode="lanczos")
    with pytest.raises(ValueError, match="old_grid"):
        resample_pos_embed(torch.randn(1, 17, 8), 8, old_grid=(3, 4))
    with pytest.raises(ValueError, match="square"):
        resample_pos_embed(torch.randn(1, 1 + 12, 8), 8)


# ----------------------------------------------------------------------------- I/O
def test_save_load_roundtrip(tmp_path):
    model = nano(pool="mean", num_classes=5).eval()
    save_model(model, tmp_path / "ckpt", extra={"epoch": 3, "classes": list("abcde")})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    loaded, meta = load_model(tmp_path / "ckpt")
    assert meta["epoch"] == 3 and meta["model"]["pool"] == "mean"
    assert loaded.config == model.config
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(loaded.eval()(x), model(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="model"):
        save_model(model, tmp_path / "bad", extra={"model": 1})


@pytest.mark.parametrize("name, damage, needle", [
    ("model.safetensors", lambda b: b[:1000], "cannot be loaded, the file is corrupt or incomplete (SafetensorError"),
    ("config.json", lambda b: b[:40], "cannot be loaded, the file is corrupt or incomplete (JSONDecodeError"),
    ("config.json", lambda b: b'{"epoch": 3}', "has no 'model' section"),
    ("config.json", lambda b: b.replace(b'"depth": 4', b'"depth": 2'), "does not fit"),
    ("config.json", lambda b: b.replace(b'"depth": 4', b'"depth": 4, "rope": true'),
     "does not describe a ViT this version can build (ValueError: unknown ViTConfig field(s) ['rope']"),
    ("config.json", lambda b: b.replace(b'"num_heads": 4', b'"num_heads": 5'),
     "does not describe a ViT this version can build (ValueError: num_heads: 5 does not divide embed_dim=64"),
], ids=["cut-weights", "cut-config", "config-without-model", "weights-that-do-not-fit", "unknown-field",
        "invalid-field"])
def test_damaged_model_directory_names_the_file(tmp_path, name, damage, needle):
    """A stage's model output damaged after it was written: one ModelFileError naming the file and what
    to do (the stage prints it as one line); a missing file stays FileNotFoundError, naming it and what to do."""
    from pipeline.model.io import REDO, ModelFileError
    save_model(nano(), tmp_path / "m")
    path = tmp_path / "m" / name
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ModelFileError) as err:
        load_model(tmp_path / "m")
    message = str(err.value)
    assert message.startswith(str(tmp_path / "m" / ("model.safetensors" if needle == "does not fit" else name)))
    assert needle in message and message.endswith("dvc repro re-runs the stage that wrote it)"), message
    path.unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_model(tmp_path / "m")
    assert (err.value.filename, err.value.strerror) == (str(path), "not found; " + REDO)


# ----------------------------------------------------------------------------- conversion parity
def _perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Random init leaves zero biases / unit LayerNorms / (torchvision) a zero head: shake them."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def test_convert_timm_same_logits():
    import timm.models.vision_transformer as timm_vit
    ref = _perturb(timm_vit.VisionTransformer(
        img_size=64, patch_size=16, embed_dim=192, depth=2, num_heads=3, num_classes=7,
    ))
    assert ref.norm.eps == 1e-6  # timm's ViT default, same as ours
    ours = build_vit("tiny", patch_size=16, image_size=64, num_classes=7, depth=2).eval()
    ours.load_state_dict(convert_state_dict(ref.state_dict(), "timm"), strict=True)
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        out, expected = ours(x), ref(x)
    assert expected.std(0).mean() > 1e-3  # logits actually depend on the image
    assert (out - expected).abs().max() <= 1e-4


def test_convert_timm_no_embed_class_same_logits():
    """timm's ``no_embed_class`` layout (DeiT III, FlexiViT: no [CLS] position) is a zero [CLS] position here."""
    import timm.models.vision_transformer as timm_vit
    ref = _perturb(timm_vit.VisionTransformer(
        img_size=64, patch_size=16, embed_dim=64, depth=2, num_heads=4, num_classes=7, no_embed_class=True,
    ))
    assert ref.pos_embed.shape[1] == 16
    ours = build_vit("nano", patch_size=16, image_size=64, num_classes=7, depth=2).eval()
    converted = convert_state_dict(ref.state_dict(), "timm")
    assert not converted["pos_embed"][:, 0].any()
    ours.load_state_dict(converted, strict=True)
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        out, expected = ours(x), ref(x)
    assert expected.std(0).mean() > 1e-3
    assert (out - expected).abs().max() <= 1e-4
    assert convert_state_dict(ref.state_dict(), "timm", grid=(6, 6))["pos_embed"].shape == (1, 37, 64)
    # a [CLS] layout whose token count is square (1 + 2*4) is told apart by its source_grid
    wide = timm_vit.VisionTransformer(img_size=(32, 64), patch_size=16, embed_dim=64, depth=2, num_heads=4)
    kept = convert_state_dict(wide.state_dict(), "timm", source_grid=(2, 4))["pos_embed"]
    assert torch.equal(kept, wide.pos_embed.detach())


def test_convert_torchvision_same_logits():
    import torchvision.models.vision_transformer as tv
    ref = _perturb(tv.VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=256, num_classes=7
    ))
    ours = build_vit("nano", patch_size=16, image_size=64, num_classes=7, depth=2).eval()
    ours.load_state_dict(convert_state_dict(ref.state_dict(), "torchvision"), strict=True)
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        out, expected = ours(x), ref(x)
    assert expected.std(0).mean() > 1e-3
    assert (out - expected).abs().max() <= 1e-4


@pytest.mark.slow
def test_convert_vit_b16_torchvision_keys_and_resample():
    import torchvision.models as tv
    with torch.device("meta"):
        sd = tv.vit_b_16(weights=None).state_dict()
    sd["encoder.pos_embedding"] = torch.randn(1, 197, 768)  # the one tensor we must compute with
    sd = {k: v if v.device.type != "meta" else torch.empty(v.shape) for k, v in sd.items()}
    ours = build_vit("base", patch_size=16, image_size=384, num_classes=1000)
    converted = convert_state_dict(sd, "torchvision", grid=ours.config.grid_size)
    assert converted["pos_embed"].shape == (1, 1 + 24 * 24, 768)
    assert torch.equal(converted["pos_embed"][:, 0], sd["encoder.pos_embedding"][:, 0])
    ours.load_state_dict(converted, strict=True)
    assert "head.weight" not in convert_state_dict(sd, "torchvision", drop_head=True)


def test_convert_rejects_unsupported_keys():
    sd = nano().state_dict()
    with pytest.raises(ValueError, match="reg_token"):
        convert_state_dict({**sd, "reg_token": torch.zeros(1, 4, 64)}, "timm")
    with pytest.raises(ValueError, match="source"):
        convert_state_dict(sd, "jax")


# ----------------------------------------------------------------------------- attention maps
def test_attention_maps_are_the_attention_used():
    model = _perturb(nano())
    x = torch.randn(2, 3, 16, 16)
    inputs = []
    hooks = [b.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for b in model.blocks]
    with torch.no_grad():
        maps = attention_maps(model, x)
    for h in hooks:
        h.remove()
    assert len(maps) == model.config.depth
    for block, attn, block_in in zip(model.blocks, maps, inputs):
        assert attn.shape == (2, 4, 17, 17)
        torch.testing.assert_close(attn.sum(-1), torch.ones(2, 4, 17))
        with torch.no_grad():
            y = block.norm1(block_in)
            _, _, v = block.attn.split_qkv(y)
            manual = block.attn.proj((attn @ v).transpose(1, 2).reshape(y.shape))
            torch.testing.assert_close(manual, block.attn(y), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- weight init
ATTENTION_WEIGHTS = (".attn.qkv.weight", ".attn.proj.weight")


def test_mimetic_init_draws_attention_as_trained_vits_look():
    torch.manual_seed(3)
    plain = nano(image_size=32)
    torch.manual_seed(3)
    mimetic = nano(image_size=32, weight_init="mimetic")
    # Only the attention weights differ: everything else is timm's init from the same draws.
    for (name, a), b in zip(plain.state_dict().items(), mimetic.state_dict().values()):
        assert torch.equal(a, b) != name.endswith(ATTENTION_WEIGHTS), name
    dim, hd = 64, 16
    for block in mimetic.blocks:
        w = block.attn.qkv.weight
        value_path = block.attn.proj.weight @ w[2 * dim:]  # W_proj W_v = 0.4 Z - 0.4 I exactly
        off_diagonal = value_path - torch.diag(value_path.diagonal())
        assert abs(value_path.diagonal().mean().item() + 0.4) < 0.05
        assert 0.04 < off_diagonal.std().item() < 0.06  # 0.4 / sqrt(64)
        for h in range(4):  # each head's W_q^T W_k: the rank-16 part of 0.7 Z + 0.7 I
            qk = w[h * hd:(h + 1) * hd].T @ w[dim + h * hd:dim + (h + 1) * hd]
            assert qk.trace().item() > 0.5 * 0.7 * hd
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        uniform = 1 / 65
        for model, low, high in ((plain, 0.5 * uniform, 2 * uniform), (mimetic, 10 * uniform, 1.0)):
            for attn in attention_maps(model, x):  # each token's attention to itself
                assert low < attn.diagonal(dim1=-2, dim2=-1).mean().item() < high


def test_unknown_weight_init_lists_the_choices():
    with pytest.raises(ValueError, match="weight_init must be one of \\('timm', 'mimetic'\\), got 'xavier'"):
        nano(weight_init="xavier")


# ----------------------------------------------------------------------------- geometry changes
@pytest.mark.parametrize("new", [12, 16])
def test_pi_resize_upsampling_is_exact(new):
    """Upsampling: resize() is injective, so <resize(x), w_new> = <x, w_old> holds exactly (float32 noise)."""
    w, x = torch.randn(16, 3, 8, 8), torch.randn(32, 3, 8, 8)
    w_new = resample_patch_embed(w, new)
    x_new = F.interpolate(x, size=(new, new), mode="bicubic", antialias=True, align_corners=False)
    out, ref = F.conv2d(x_new, w_new, stride=new), F.conv2d(x, w, stride=8)
    assert (out - ref).abs().max() / ref.abs().mean() < 1e-4


def test_pi_resize_downsampling_beats_naive_resize():
    """Downsampling loses information: PI-resize is only the least-squares best, so compare to a baseline."""
    w, x = torch.randn(16, 3, 16, 16), torch.randn(256, 3, 16, 16)
    x_new = F.interpolate(x, size=(8, 8), mode="bicubic", antialias=True, align_corners=False)
    ref = F.conv2d(x, w, stride=16)
    pi = F.conv2d(x_new, resample_patch_embed(w, 8), stride=8)
    naive_w = F.interpolate(w, size=(8, 8), mode="bicubic", antialias=True, align_corners=False) * 4
    naive = F.conv2d(x_new, naive_w, stride=8)
    assert (pi - ref).pow(2).mean() < (naive - ref).pow(2).mean()
    assert torch.equal(resample_patch_embed(w, 16), w)


def test_set_input_size_16_to_32_then_train_step():
    model = nano()
    pos_cls = model.pos_embed[:, :1].detach().clone()
    model.set_input_size(32)
    assert model.config.image_size == (32, 32) and model.pos_embed.shape == (1, 1 + 64, 64)
    assert torch.equal(model.pos_embed[:, :1], pos_cls)
    model.train()
    logits = model(torch.randn(4, 3, 32, 32))
    loss = F.cross_entropy(logits, torch.tensor([0, 1, 2, 3]))
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    loss.backward()
    assert model.pos_embed.grad is not None and torch.isfinite(model.pos_embed.grad).all()


def test_set_input_size_patch_change_keeps_tokens_close():
    """Patch 4 -> 8, image 16 -> 32, same 4x4 grid. A 2x nearest upsample of the image is a per-patch
    upsample, so with PI-resize (same mode) every token, hence every logit, is unchanged."""
    model = _perturb(nano())
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        before = model(x)
        model.set_input_size(32, 8, mode="nearest")
        after = model(F.interpolate(x, size=(32, 32), mode="nearest"))
    assert model.config.patch_size == (8, 8) and model.patch_embed.proj.weight.shape[-2:] == (8, 8)
    assert model.config.grid_size == (4, 4)
    torch.testing.assert_close(after, before, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="divisible"):
        model.set_input_size(36)


def test_dynamic_img_size():
    model = nano(dynamic_img_size=True).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), nano_copy(model)(x))
        assert model(torch.randn(2, 3, 24, 32)).shape == (2, 10)
        assert model.forward_features(torch.randn(1, 3, 8, 12)).shape == (1, 1 + 6, 64)
    with pytest.raises(ValueError, match="divisible"):
        model(torch.randn(1, 3, 18, 16))
    assert model.pos_embed.shape == (1, 17, 64)  # the stored embedding is untouched


def nano_copy(model):
    clone = VisionTransformer(model.config).eval()
    clone.load_state_dict(model.state_dict())
    return clone


def test_reset_classifier():
    model = nano()
    model.reset_classifier(3)
    assert model.config.num_classes == 3 and model.head.out_features == 3
    assert torch.count_nonzero(model.head.weight) == 0
    model.reset_classifier(0)
    assert isinstance(model.head, torch.nn.Identity) and model.config.num_classes == 0


# ----------------------------------------------------------------------------- stochastic depth
def test_drop_path_rates_ramp_linearly():
    model = build_vit("micro", patch_size=4, image_size=16, num_classes=10, drop_path_rate=0.5)
    rates = [b.drop_path.drop_prob for b in model.blocks]
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.5)
    assert rates == pytest.approx([0.1 * i for i in range(6)])


def test_drop_path_eval_deterministic_train_stochastic():
    model = nano(drop_path_rate=0.5)
    x = torch.randn(8, 3, 16, 16)
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)
        model.train()
        assert not torch.allclose(model(x), model(x))
        deterministic = nano().train()  # no dropout of any kind configured
        torch.testing.assert_close(deterministic(x), deterministic(x), rtol=0, atol=0)


# ----------------------------------------------------------------------------- activation checkpointing
def _saved_bytes(model: VisionTransformer, x: torch.Tensor) -> int:
    """Bytes of the distinct storages that autograd keeps for backward after one forward."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(kept.values())


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_grad_checkpointing_gives_the_same_gradients_and_keeps_less(pool):
    """Checkpointed blocks (both forward paths) give bit-identical loss and gradients, stochastic depth
    included (its masks are replayed), and autograd keeps a fraction of the activations."""
    torch.manual_seed(0)
    base = build_vit("nano", patch_size=4, image_size=32, num_classes=10, pool=pool, drop_path_rate=0.3)
    x, y = torch.randn(16, 3, 32, 32), torch.arange(16) % 10
    grads, kept = [], []
    for enable in (False, True):
        model = build_vit("nano", patch_size=4, image_size=32, num_classes=10, pool=pool, drop_path_rate=0.3)
        model.load_state_dict(base.state_dict())
        model.set_grad_checkpointing(enable)
        torch.manual_seed(7)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        kept.append(_saved_bytes(model, x))
    (loss0, g0), (loss1, g1) = grads
    assert torch.equal(loss0, loss1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    assert kept[1] * 4 < kept[0], kept  # nano, 65 tokens: ~12x less here
    model.eval()
    with torch.no_grad():  # inference ignores the setting
        torch.testing.assert_close(model(x), base.eval()(x), rtol=0, atol=0)


def test_finetune_start_from_timm_weights_file(tmp_path):
    """`finetune.init` + `init_source: timm`: a timm checkpoint at its own patch/grid is loaded, then moved
    to the fine-tune resolution and patch size; features match timm's before the move."""
    import timm.models.vision_transformer as tvit

    from pipeline.config import load_params
    from pipeline.train.stage import load_finetune_start

    ref = tvit.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=7,
                                 global_pool="token").eval()
    torch.save(ref.state_dict(), tmp_path / "timm.pt")
    root = Path(__file__).resolve().parents[1]
    params = load_params(root / "params.yaml", overrides={
        "model.depth": 2, "finetune.init": str(tmp_path / "timm.pt"), "finetune.init_source": "timm",
        "finetune.image_size": 48, "finetune.patch_size": 4})
    model = load_finetune_start(params, classes=list("0123456789")).eval()
    assert model.config.image_size == (48, 48) and model.config.patch_size == (4, 4)
    assert model.config.num_classes == 10
    assert torch.isfinite(model(torch.randn(2, 3, 48, 48))).all()
    with torch.no_grad():  # the [CLS] position embedding is carried over unchanged
        assert torch.equal(model.pos_embed[:, :1], ref.pos_embed[:, :1])
    bad = load_params(root / "params.yaml", overrides={"finetune.init": str(tmp_path / "timm.pt"),
                                                        "finetune.init_source": "timm"})
    with pytest.raises(ValueError, match="64 wide but model.preset='nano'|does not fit"):
        load_finetune_start(bad, classes=list("0123456789"))
    (tmp_path / "cut.pt").write_bytes((tmp_path / "timm.pt").read_bytes()[:2000])
    cut = load_params(root / "params.yaml", overrides={"finetune.init": str(tmp_path / "cut.pt")})
    with pytest.raises(ValueError, match=f"^{tmp_path / 'cut.pt'}: cannot be loaded, the file is corrupt or "
                                         "incomplete .*; finetune.init must name a model directory"):
        load_finetune_start(cut, classes=list("0123456789"))
    ours = tmp_path / "ours"
    save_model(nano(), ours)  # this pipeline's layout, given as torchvision's
    wrong = load_params(root / "params.yaml", overrides={"finetune.init": str(ours / "model.safetensors"),
                                                          "finetune.init_source": "torchvision"})
    with pytest.raises(ValueError, match=rf"^finetune.init: {ours / 'model.safetensors'}: \d+ torchvision key\(s\) "
                                         r"have no equivalent .*\(is finetune.init_source='torchvision' right\? "
                                         r"valid: pipeline, timm, torchvision\)$"):
        load_finetune_start(wrong, classes=list("0123456789"))


def test_finetune_start_refuses_a_weights_file_that_does_not_fit(tmp_path):
    """A weights file records no grid shape: non-square patches or grids are refused (a model directory has
    them), and any shape mismatch is a ValueError naming the file, the keys and the params to set."""
    import timm.models.vision_transformer as tvit

    from pipeline.config import load_params
    from pipeline.train.stage import load_finetune_start

    root = Path(__file__).resolve().parents[1]

    def start(name, **timm_kw):
        kw = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 2, "num_heads": 4, "num_classes": 0,
              **timm_kw}
        torch.save(tvit.VisionTransformer(**kw).state_dict(), tmp_path / name)
        params = load_params(root / "params.yaml", overrides={
            "model.depth": 2, "finetune.init": str(tmp_path / name), "finetune.init_source": "timm",
            "finetune.image_size": 32, "finetune.patch_size": 4})
        return load_finetune_start(params, classes=list("0123456789"))

    for name, kw in (("patch.pt", {"patch_size": (8, 4)}), ("grid.pt", {"img_size": (16, 24)})):
        with pytest.raises(ValueError, match=rf"^finetune.init: {tmp_path / name} has .* give a model directory"):
            start(name, **kw)
    with pytest.raises(ValueError, match=rf"^finetune.init: {tmp_path / 'mlp.pt'} does not fit .*"
                                         r"blocks.0.mlp.fc1.weight \[128, 64\] vs \[256, 64\].*"
                                         r"set model.preset / embed_dim / depth / num_heads / mlp_ratio"):
        start("mlp.pt", mlp_ratio=2.0)
    with pytest.raises(ValueError, match=r"does not fit .*unexpected \['blocks.2.*depth"):
        start("deep.pt", depth=3)
    assert not start("flexi.pt", no_embed_class=True).pos_embed[:, 0].any()  # timm's no_embed_class layout
    ours = tmp_path / "ours"  # a non-square grid comes as a model directory
    save_model(nano(image_size=(8, 32), num_classes=0, depth=2), ours)
    start_dir = load_params(root / "params.yaml", overrides={"finetune.init": str(ours), "model.depth": 2,
                                                               "finetune.image_size": 32, "finetune.patch_size": 4})
    assert load_finetune_start(start_dir, classes=list("0123456789")).config.grid_size == (8, 8)


def test_finetune_start_from_a_model_directory_is_the_model_section_s(tmp_path):
    """A model directory (models/pretrain, or one ``finetune.init`` names) must be the network params.yaml's
    model section describes, which the run logs and hashes: another depth is one line naming both values;
    ``drop_path_rate`` (no weights) is the section's, not the directory's (it was silently the directory's)."""
    from pipeline.config import load_params
    from pipeline.train.stage import load_finetune_start

    root = Path(__file__).resolve().parents[1]
    save_model(nano(depth=2), tmp_path / "pre", extra={"classes": list("0123456789")})

    def start(**overrides):
        params = load_params(root / "params.yaml", overrides={"finetune.image_size": 16, **overrides})
        return load_finetune_start(params, list("0123456789"), pretrained=tmp_path / "pre")

    with pytest.raises(ValueError, match=rf"^finetune.init: {tmp_path / 'pre'} is a model with depth=2, but "
                                         r"params.yaml's model section gives depth=4: set model.\* to match"):
        start()
    model = start(**{"model.depth": 2, "model.drop_path_rate": 0.3})
    assert model.config.drop_path_rate == 0.3 and model.blocks[-1].drop_path.drop_prob == pytest.approx(0.3)
    scratch = load_finetune_start(load_params(root / "params.yaml", overrides={
        "finetune.init": "scratch", "finetune.image_size": 32, "finetune.patch_size": 8}), list("0123456789"))
    fresh = build_vit("nano", patch_size=8, image_size=32, num_classes=10)
    assert scratch.pos_embed.std().item() == pytest.approx(fresh.pos_embed.std().item(), rel=0.2)
    assert scratch.patch_embed.proj.weight.shape == fresh.patch_embed.proj.weight.shape


def test_finetune_init_files_that_hold_no_weights_are_one_line(tmp_path):
    """A .pt holding a tensor or a list, or a training checkpoint (more than weights), is a ValueError naming
    the file and what finetune.init wants (they were an AttributeError traceback, or "corrupt");
    a state dict under ``state_dict`` or ``model`` (timm's, DeiT's checkpoints) is read."""
    import numpy as np

    from pipeline.config import load_params
    from pipeline.train.stage import load_finetune_start

    root = Path(__file__).resolve().parents[1]

    def start(name):
        params = load_params(root / "params.yaml", overrides={"finetune.init": str(tmp_path / name)})
        return load_finetune_start(params, list("0123456789"))

    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    with pytest.raises(ValueError, match=rf"^finetune.init: {tmp_path / 'tensor.pt'} holds a Tensor, not a state "
                                         "dict of tensors; finetune.init must name a model directory"):
        start("tensor.pt")
    torch.save({"model": nano().state_dict(), "rng": np.random.get_state()}, tmp_path / "state.pt")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'state.pt'} holds more than weights \(a training "
                                         "checkpoint"):
        start("state.pt")
    class Planted:  # a pickle that runs a command when loaded: refused as more than weights, never run
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    torch.save({"model": Planted()}, tmp_path / "planted.pt")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'planted.pt'} holds more than weights"):
        start("planted.pt")
    assert not (tmp_path / "ran").exists()
    (tmp_path / "noise.pt").write_bytes(bytes(range(7, 207)))  # no pickle at all: damaged, not a checkpoint
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'noise.pt'}: cannot be loaded, the file is corrupt, "
                                         "incomplete or not written by torch.save; finetune.init must name"):
        start("noise.pt")
    torch.save({"state_dict": nano().state_dict(), "epoch": 3}, tmp_path / "wrapped.pt")
    assert start("wrapped.pt").config.depth == 4


def test_finetune_keeps_the_head_only_for_the_pretrained_classes(tmp_path, capsys):
    """``finetune.head: auto`` keeps models/pretrain's head when the fine-tune data has its classes in its
    order (a new resolution on the same data), else a new zero head; ``head: new`` always a new one."""
    from pipeline.config import ConfigError, load_params
    from pipeline.train.stage import load_finetune_start

    root = Path(__file__).resolve().parents[1]
    pre = nano(num_classes=3)
    torch.nn.init.normal_(pre.head.weight)
    save_model(pre, tmp_path / "pre", extra={"classes": ["cat", "dog", "eel"]})

    def head(classes, **overrides):
        params = load_params(root / "params.yaml", overrides=overrides)
        return load_finetune_start(params, classes, pretrained=tmp_path / "pre").head.weight

    assert torch.equal(head(["cat", "dog", "eel"]), pre.head.weight)
    assert "[finetune] keeps the pretrained head: the data has its 3 classes" in capsys.readouterr().out
    assert not head(["dog", "cat", "eel"]).any()  # same names, other order: the logits would swap
    assert not head(["cat", "dog"]).any() and head(["cat", "dog"]).shape[0] == 2
    assert not head(["cat", "dog", "eel"], **{"finetune.head": "new"}).any()
    assert not head(["cat", "dog", "eel"], **{"finetune.init": "scratch"}).any()  # no pretrained classes to match
    assert "keeps the pretrained head" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"finetune.head.*'keep'.*auto, new"):
        load_params(root / "params.yaml", overrides={"finetune.head": "keep"})


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["--cases", "nano,foo"], "--cases: foo not among nano, tiny"),
    (["--threads", "0"], "argument --threads: '0' is not valid: must be an integer >= 1"),  # torch raised
    (["--rounds", "-2"], "argument --rounds: '-2' is not valid: must be an integer >= 1"),  # an IndexError
    (["--budget", "nan"], "argument --budget: 'nan' is not valid: must be a number of seconds >= 0"),  # never stopped
])
def test_speed_benchmark_refuses_bad_arguments(args, says):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "benchmarks/model_speed.py", *args],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"model_speed.py: error: {says}"


@pytest.mark.slow
def test_speed_benchmark_against_timm_runs():
    """``benchmarks/model_speed.py`` (docs/model.md's comparison with timm), shrunk to the nano case, with
    its noise control and kernel breakdown: both modes timed for ours, timm and the copy, same logits."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/model_speed.py", "--cases", "nano", "--rounds", "2",
                           "--budget", "5", "--threads", "1", "--control", "--breakdown"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mode in ("train", "infer"):
        row = re.search(rf"nano 16px/p4 b128 +{mode} +([\d.]+) +([\d.]+) +([\d.]+)x .*ours-copy: ([\d.]+) img/s",
                        proc.stdout)
        assert row and min(float(v) for v in row.groups()) > 0, proc.stdout
        parts = re.findall(rf"nano 16px/p4 b128 +{mode} (ours|timm|ours-copy) +matmul\+conv +([\d.]+) ms", proc.stdout)
        assert sorted(name for name, _ in parts) == ["ours", "ours-copy", "timm"], proc.stdout
    diff = float(re.search(r"max \|logit diff\| ours vs timm \(same weights\): (\S+)", proc.stdout)[1])
    assert diff < 1e-4  # the same function: the speed ratio compares like with like
