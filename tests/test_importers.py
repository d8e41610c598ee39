"""Importers: the SAN authors' checkpoints and torchvision-layout ResNets.

The SAN tests fill a state dict in the authors' layout (hszhao/SAN ``model/san.py``), written
here from their architecture, with random values, convert it, and compare our model's forward
with a slow forward computed directly from the authors'-layout tensors (the SAN paper's eq. 2-5
as the authors' code arranges them: subtraction relation + encoded position differences,
``conv_w`` = BN-ReLU-conv-BN-ReLU-conv, softmax over the footprint for pairwise, unfolded conv2
features for patchwise, aggregation with ``c % G`` weight sharing and single-mirror reflection
padding, as their CUDA kernels index it). The reference uses no robust-attn layer.
"""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F

from robust_attn.models.checkpoint import load_checkpoint
from robust_attn.cli import main
from robust_attn.importers import ConversionError, read_state_dict
from robust_attn.importers.san_official import convert_san_official, import_san_official
from robust_attn.importers.torchvision_resnet import convert_torchvision_resnet
from robust_attn.models.registry import create_model

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)

# The authors' configurations (config/imagenet/*.yaml): blocks per stage and footprints.
OFFICIAL = {"san10": ((2, 1, 2, 4, 1), (3, 7, 7, 7, 7)), "san15": ((3, 2, 3, 5, 2), (3, 7, 7, 7, 7)),
            "san19": ((3, 3, 4, 6, 3), (3, 7, 7, 7, 7))}


# ------------------------------------------------------------------------------------------------
# The authors' layout, written from model/san.py


def official_shapes(depth: str, pairwise: bool, num_classes: int = 1000) -> dict[str, tuple]:
    layers, kernels = OFFICIAL[depth]
    shapes: dict[str, tuple] = {}

    def bn(name, ch):
        shapes.update({f"{name}.weight": (ch,), f"{name}.bias": (ch,), f"{name}.running_mean": (ch,),
                       f"{name}.running_var": (ch,), f"{name}.num_batches_tracked": ()})

    def conv(name, cout, cin, bias=True):
        shapes[f"{name}.weight"] = (cout, cin, 1, 1)
        if bias:
            shapes[f"{name}.bias"] = (cout,)

    conv("conv_in", 64, 3, bias=False)
    bn("bn_in", 64)
    prev = 64
    for s, (blocks, k, c) in enumerate(zip(layers, kernels, (64, 256, 512, 1024, 2048))):
        conv(f"conv{s}", c, prev, bias=False)
        rel, mid = c // 16, c // 4
        groups, area = mid // 8, k * k
        for i in range(blocks):
            p = f"layer{s}.{i}"
            bn(f"{p}.bn1", c)
            conv(f"{p}.sam.conv1", rel, c)
            conv(f"{p}.sam.conv2", rel, c)
            conv(f"{p}.sam.conv3", mid, c)
            if pairwise:
                bn(f"{p}.sam.conv_w.0", rel + 2)
                conv(f"{p}.sam.conv_w.2", rel, rel + 2, bias=False)
                bn(f"{p}.sam.conv_w.3", rel)
                conv(f"{p}.sam.conv_w.5", groups, rel)
                conv(f"{p}.sam.conv_p", 2, 2)
            else:
                bn(f"{p}.sam.conv_w.0", rel * (area + 1))
                conv(f"{p}.sam.conv_w.2", groups, rel * (area + 1), bias=False)
                bn(f"{p}.sam.conv_w.3", groups)
                conv(f"{p}.sam.conv_w.5", area * groups, groups)
            bn(f"{p}.bn2", mid)
            conv(f"{p}.conv", c, mid)
        bn(f"bn{s}", c)
        prev = c
    shapes["fc.weight"], shapes["fc.bias"] = (num_classes, 2048), (num_classes,)
    return shapes


def random_official(depth: str, pairwise: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values of a sane scale (activations neither vanish nor blow up over 10 blocks)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in official_shapes(depth, pairwise).items():
        if name.endswith("num_batches_tracked"):
            out[name] = torch.tensor(1234)
        elif name.endswith(("running_var",)) or (name.endswith("weight") and len(shape) == 1):
            out[name] = 0.5 + torch.rand(shape, generator=g)
        elif name.endswith(("running_mean", "bias")):
            out[name] = 0.1 * torch.randn(shape, generator=g)
        else:  # conv / fc weight
            gain = 0.3 if name.endswith(".conv.weight") else 1.0  # the residual branch's last layer
            if not pairwise and name.endswith("conv_w.5.weight"):
                gain = 1 / OFFICIAL[depth][1][-1]   # patchwise weights are not normalized: sum of k^2 ~ 1
            out[name] = gain * torch.randn(shape, generator=g) / shape[1] ** 0.5
    return out


# ------------------------------------------------------------------------------------------------
# The slow reference, from the authors'-layout tensors


def ref_bn(sd, name, x):
    shape = (1, -1) + (1,) * (x.dim() - 2)
    scale = sd[f"{name}.weight"] / torch.sqrt(sd[f"{name}.running_var"] + 1e-5)
    return (x - sd[f"{name}.running_mean"].view(shape)) * scale.view(shape) + sd[f"{name}.bias"].view(shape)


def ref_conv1x1(sd, name, x):
    out = torch.einsum("oc,nc...->no...", sd[f"{name}.weight"][:, :, 0, 0], x)
    if f"{name}.bias" in sd:
        out = out + sd[f"{name}.bias"].view((1, -1) + (1,) * (x.dim() - 2))
    return out


def ref_neighbours(x, k, small_maps=False):
    """(N, c, k*k, H, W): x at (h - k//2 + kh, w - k//2 + kw), index kh*k + kw, mirrored once at
    the borders exactly as the authors' *_refpad CUDA kernels index (-h; 2(H-1) - h).

    On a map no larger than half the footprint the authors' kernels read out of bounds; with
    ``small_maps`` the mirroring is repeated there (period 2 (H - 1); a 1-pixel map is constant),
    the extension the SAN layer defines, so smaller inputs still check the conversion."""
    n, c, h, w = x.shape
    pad = k // 2
    assert small_maps or (h > pad and w > pad), "the authors' single mirror needs maps larger than half the footprint"

    def mirror(idx, size):
        if size == 1:
            return torch.zeros_like(idx)
        idx = idx.remainder(2 * (size - 1)) if small_maps else idx
        idx = torch.where(idx < 0, -idx, idx)
        return torch.where(idx >= size, 2 * (size - 1) - idx, idx)

    out = x.new_empty(n, c, k * k, h, w)
    for kh in range(k):
        for kw in range(k):
            hi = mirror(torch.arange(h) - pad + kh, h)
            wi = mirror(torch.arange(w) - pad + kw, w)
            out[:, :, kh * k + kw] = x[:, :, hi][:, :, :, wi]
    return out


def ref_sam(sd, p, x, k, pairwise, small_maps=False):
    n, _, h, w = x.shape

    def neighbours(t):
        return ref_neighbours(t, k, small_maps)

    x1, x2, x3 = (ref_conv1x1(sd, f"{p}.conv{i}", x) for i in (1, 2, 3))

    def conv_w(t):
        t = ref_conv1x1(sd, f"{p}.conv_w.2", F.relu(ref_bn(sd, f"{p}.conv_w.0", t)))
        return ref_conv1x1(sd, f"{p}.conv_w.5", F.relu(ref_bn(sd, f"{p}.conv_w.3", t)))

    if pairwise:  # eq. 2-3 with the subtraction relation and position encoding
        loc_w = torch.linspace(-1, 1, w, dtype=x.dtype).repeat(h, 1)            # x: along the width
        loc_h = torch.linspace(-1, 1, h, dtype=x.dtype)[:, None].repeat(1, w)   # y: along the height
        pos = ref_conv1x1(sd, f"{p}.conv_p", torch.stack([loc_w, loc_h])[None])
        delta = x1[:, :, None] - neighbours(x2)
        dpos = (pos[:, :, None] - neighbours(pos)).expand(n, -1, -1, -1, -1)
        weight = torch.softmax(conv_w(torch.cat([delta, dpos], 1)), dim=2)      # (N, G, K, H, W)
    else:  # eq. 4-5, concatenation: [x1_i, x2_j for all j], channel-major
        cat = torch.cat([x1, neighbours(x2).reshape(n, -1, h, w)], 1)
        weight = conv_w(cat).reshape(n, -1, k * k, h, w)
    groups = weight.shape[1]
    v = neighbours(x3)
    out = torch.zeros_like(x3)
    for c in range(x3.shape[1]):   # channel c uses weight group c % G
        out[:, c] = (weight[:, c % groups] * v[:, c]).sum(1)
    return out


def ref_san(sd, x, depth, pairwise, small_maps=False):
    layers, kernels = OFFICIAL[depth]
    x = F.relu(ref_bn(sd, "bn_in", ref_conv1x1(sd, "conv_in", x)))
    for s, (blocks, k) in enumerate(zip(layers, kernels)):
        x = ref_conv1x1(sd, f"conv{s}", F.max_pool2d(x, 2, 2))
        for i in range(blocks):
            p = f"layer{s}.{i}"
            out = ref_sam(sd, f"{p}.sam", F.relu(ref_bn(sd, f"{p}.bn1", x)), k, pairwise, small_maps)
            x = x + ref_conv1x1(sd, f"{p}.conv", F.relu(ref_bn(sd, f"{p}.bn2", out)))
        x = F.relu(ref_bn(sd, f"bn{s}", x))
    return x.mean((2, 3)) @ sd["fc.weight"].t() + sd["fc.bias"]


# ------------------------------------------------------------------------------------------------
# SAN


def _check_san_import(tmp_path, attention, size, depth="san10", images=2):
    official = random_official(depth, attention == "pairwise")
    arch = f"{depth}_{attention}"
    src = tmp_path / f"{arch}.pth"
    # as the authors' training script saves it: DataParallel prefix, a state_dict key
    torch.save({"epoch": 100, "state_dict": {f"module.{k}": v for k, v in official.items()}}, src)
    out = tmp_path / "imported.safetensors"
    import_san_official(src, arch, out)
    model = load_checkpoint(out).double()
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["origin"]["importer"] == "san-official"
    assert meta["origin"]["source_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert meta["arch"]["name"] == arch and meta["arch"]["resolution"] == "imagenet"
    torch.testing.assert_close(torch.tensor(meta["mean"]), MEAN.flatten())
    torch.testing.assert_close(torch.tensor(meta["std"]), STD.flatten())

    x = torch.rand(images, 3, size, size, dtype=torch.float64)
    sd = {k: v.double() for k, v in official.items()}
    with torch.no_grad():
        ours = model(x)
        ref = ref_san(sd, (x - MEAN.double()) / STD.double(), depth, attention == "pairwise", small_maps=size < 128)
    assert ref.std() > 0.1 and torch.isfinite(ref).all()  # a non-degenerate comparison
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-10 * ref.abs().max().item())  # float64


@pytest.mark.parametrize("attention", ["pairwise", "patchwise"])
def test_san_official_import_matches_the_authors_forward(tmp_path, attention):
    # 128 px: the smallest input whose last stage (4x4) the authors' single mirror can pad (pad 3)
    _check_san_import(tmp_path, attention, 128)


@pytest.mark.parametrize("attention", ["pairwise", "patchwise"])
@pytest.mark.parametrize("depth", ["san10", "san15", "san19"])
def test_san_official_import_of_every_depth_matches_the_authors_forward_at_64_px(tmp_path, depth, attention):
    """Every block layout of the authors' configurations (SAN10/15/19: 2-1-2-4-1, 3-2-3-5-2,
    3-3-4-6-3 blocks), one 64 px image: stages 0-3 (maps 32 to 4 px) padded as the authors'
    kernels do, the last (2 px) by repeated mirroring (see ``ref_neighbours``)."""
    _check_san_import(tmp_path, attention, 64, depth, images=1)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["pairwise", "patchwise"])
def test_san_official_import_matches_the_authors_forward_at_224(tmp_path, attention):
    _check_san_import(tmp_path, attention, 224)


def test_san_conversion_moves_every_tensor_once_unchanged():
    official = random_official("san10", True)
    ours = convert_san_official(official, "san10_pairwise")
    assert set(ours) == set(create_model("san10_pairwise").state_dict())

    def fingerprints(sd):  # random values: a tensor's shape and first values identify it
        return sorted((tuple(v.shape), tuple(v.flatten()[:3].tolist())) for v in sd.values() if v.numel() > 1)
    assert fingerprints(ours) == fingerprints(official)
    assert torch.equal(ours["stages.3.5.attn.pos.weight"], official["layer3.3.sam.conv_p.weight"])
    assert torch.equal(ours["stages.3.6.running_var"], official["bn3.running_var"])


def test_san_wrong_arch_is_refused_with_the_arch_the_keys_describe():
    official = random_official("san10", True)
    with pytest.raises(ConversionError, match="san10_pairwise") as err:
        convert_san_official(official, "san10_patchwise")
    assert "layer0.0.sam.conv_w.0.weight" in str(err.value)   # pairwise BN width vs patchwise
    assert "sam.conv_p" in str(err.value)                       # unexpected in a patchwise model
    with pytest.raises(ConversionError, match="--arch san15_patchwise"):
        convert_san_official(random_official("san15", False), "san10_patchwise")
    with pytest.raises(ConversionError, match="not a SAN architecture"):
        convert_san_official(official, "resnet50")


def test_san_missing_extra_and_misshaped_keys_are_named():
    official = random_official("san10", False)
    del official["layer3.2.sam.conv3.bias"]
    official["layer1.0.extra.weight"] = torch.zeros(3)
    official["fc.bias"] = torch.zeros(999)
    with pytest.raises(ConversionError) as err:
        convert_san_official(official, "san10_patchwise")
    msg = str(err.value)
    assert "missing key(s): layer3.2.sam.conv3.bias" in msg
    assert "unexpected key(s): layer1.0.extra.weight" in msg
    assert "fc.bias (999,) (needs (1000,))" in msg
    # BatchNorm's counter may be absent (old checkpoints): accepted, our zero kept
    official = random_official("san10", False)
    official = {k: v for k, v in official.items() if not k.endswith("num_batches_tracked")}
    ours = convert_san_official(official, "san10_patchwise")
    assert int(ours["stem.1.num_batches_tracked"]) == 0
    assert torch.equal(ours["stem.0.weight"], official["conv_in.weight"])


# ------------------------------------------------------------------------------------------------
# torchvision ResNet


def _randomize_bn(model, seed=1):
    """torchvision initializes BN to identity (weight 1, bias 0, stats 0/1): randomize it so a
    misplaced BN tensor would change the output."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            c = m.num_features
            m.weight.data = 0.5 + torch.rand(c, generator=g)
            m.bias.data = 0.1 * torch.randn(c, generator=g)
            m.running_mean = 0.1 * torch.randn(c, generator=g)
            m.running_var = 0.5 + torch.rand(c, generator=g)
    return model.eval()


@pytest.fixture
def tv_resnet50():
    torchvision = pytest.importorskip("torchvision")
    return _randomize_bn(torchvision.models.resnet50(weights=None))


def test_torchvision_resnet50_imports_through_the_cli_and_matches_torchvision(tmp_path, tv_resnet50, capsys):
    src = tmp_path / "tv_resnet50.pth"
    torch.save(tv_resnet50.state_dict(), src)
    assert main(["zoo", "import", "torchvision-resnet", str(src), "--arch", "resnet50"]) == 0
    out = tmp_path / "tv_resnet50.safetensors"
    assert str(out) in capsys.readouterr().out
    model = load_checkpoint(out)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["origin"]["source_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        expected = tv_resnet50((x - MEAN) / STD)
        assert expected.std() > 0.01
        torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)
    # an existing output is not overwritten unless asked
    assert main(["zoo", "import", "torchvision-resnet", str(src), "--arch", "resnet50"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["zoo", "import", "torchvision-resnet", str(src), "--arch", "resnet50", "--force"]) == 0


def test_torchvision_resnet_dataparallel_checkpoint_and_other_class_count(tv_resnet50, tmp_path):
    torchvision = pytest.importorskip("torchvision")
    tv = _randomize_bn(torchvision.models.resnet50(weights=None, num_classes=10))
    src = tmp_path / "dp.pth.tar"
    torch.save({"state_dict": {f"module.{k}": v for k, v in tv.state_dict().items()}, "epoch": 3}, src)
    net = create_model("resnet50", 10, "imagenet")
    net.load_state_dict(convert_torchvision_resnet(read_state_dict(src), "resnet50"))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(net.eval()(x), tv(x), rtol=1e-4, atol=1e-5)


def test_torchvision_layout_errors_name_the_keys(tv_resnet50):
    torchvision = pytest.importorskip("torchvision")
    sd = tv_resnet50.state_dict()
    with pytest.raises(ConversionError, match="BasicBlock"):
        convert_torchvision_resnet(torchvision.models.resnet18(weights=None).state_dict(), "resnet50")
    bad = dict(sd)
    bad["layer1.0.conv2.weight"] = torch.zeros(64, 64, 1, 1)
    with pytest.raises(ConversionError, match=r"layer1\.0\.conv2\.weight \(64, 64, 1, 1\) \(needs \(64, 64, 3, 3\)\)"):
        convert_torchvision_resnet(bad, "resnet50")
    bad = {k: v for k, v in sd.items() if k != "bn1.running_var"}
    bad["stem.0.weight"] = sd["conv1.weight"]
    with pytest.raises(ConversionError) as err:
        convert_torchvision_resnet(bad, "resnet50")
    assert "missing key(s): bn1.running_var" in str(err.value) and "unexpected key(s): stem.0.weight" in str(err.value)
    with pytest.raises(ConversionError, match=r"\[3, 4, 6, 3\] blocks per stage: pass --arch resnet50"):
        convert_torchvision_resnet(sd, "resnet26")
    with pytest.raises(ConversionError, match="no registered ResNet"):
        convert_torchvision_resnet(torchvision.models.resnet101(weights=None).state_dict(), "resnet50")
    with pytest.raises(ConversionError, match="not a ResNet baseline"):
        convert_torchvision_resnet(sd, "san10_pairwise")


def test_files_that_are_not_state_dicts_are_refused_through_the_cli(tmp_path, capsys):
    cases = {"list.pth": [torch.zeros(2)], "module.pth": torch.nn.Linear(2, 2),
             "mixed.pth": {"conv1.weight": torch.zeros(1), "note": "hello"}}
    for name, obj in cases.items():
        torch.save(obj, tmp_path / name)
    (tmp_path / "junk.pth").write_bytes(b"<html>not found</html>")
    expect = {"list.pth": "holds a list, not a state dict", "module.pth": "save `model.state_dict()`",
              "mixed.pth": "entries that are not tensors: note", "junk.pth": "not a torch.save checkpoint",
              "absent.pth": "does not exist"}
    for name, text in expect.items():
        assert main(["zoo", "import", "torchvision-resnet", str(tmp_path / name), "--arch", "resnet50"]) == 2
        assert text in capsys.readouterr().err, name
    assert main(["zoo", "import", "san-official", str(tmp_path / "list.pth"), "--arch", "san10_pairwise",
                 "--out", str(tmp_path / "x.pt")]) == 2
    assert ".safetensors" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.safetensors"))
