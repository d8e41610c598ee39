"""Attention-augmented convolution (AA, Bello et al. 2019) and the AA-ResNet / AA-WRN zoo entries."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from robust_attn import create_model
from robust_attn.models.complexity import count_params, model_complexity
from robust_attn.layers.aa import AugmentedConv2d, aa_dims, relative_logits
from robust_attn.models.aa import PAPER_MACS
from robust_attn.models.resnet import build_resnet
from robust_attn.models.reference import imagenet_reference, reference_table


# -- independent slow references, written from AA equations 1-4 -------------------------------------
def naive_relative_logits(q, rel_h, rel_w):
    """S_H + S_W of AA equation 4 by storing every relative embedding r_ij: (HW, HW, d) per pair.
    q: (h, w, d) -> (h*w, h*w)."""
    h, w, d = q.shape
    pos = [(y, x) for y in range(h) for x in range(w)]
    r = torch.stack([torch.stack([rel_h[yj - yi + h - 1] + rel_w[xj - xi + w - 1] for (yj, xj) in pos])
                     for (yi, xi) in pos])                                      # (HW, HW, d)
    return torch.einsum("id,ijd->ij", q.reshape(h * w, d), r)


def slow_augmented_conv(m: AugmentedConv2d, x: torch.Tensor) -> torch.Tensor:
    """Concat[Conv(X), MHA(X)] with per-head, per-query loops (AA equations 1-4, section 3.2)."""
    conv = F.conv2d(x, m.conv.weight, stride=m.stride, padding=1) if m.conv is not None else None
    a = x
    for _ in range(int(math.log2(m.stride * m.attn_pool))):
        a = F.avg_pool2d(a, 3, 2, 1, count_include_pad=False)
    n, _, h, w = a.shape
    X = a.permute(0, 2, 3, 1).reshape(n, h * w, -1)                             # (N, HW, F_in)
    Wqkv = m.qkv.weight[:, :, 0, 0]
    Wq, Wk, Wv = Wqkv[:m.dk], Wqkv[m.dk:2 * m.dk], Wqkv[2 * m.dk:]
    outs = []
    for b in range(n):
        heads = []
        for hd in range(m.heads):
            sl_k = slice(hd * m.dkh, (hd + 1) * m.dkh)
            sl_v = slice(hd * m.dvh, (hd + 1) * m.dvh)
            Q, K, V = X[b] @ Wq[sl_k].T, X[b] @ Wk[sl_k].T, X[b] @ Wv[sl_v].T
            L = torch.empty(h * w, h * w)
            for i in range(h * w):
                yi, xi = divmod(i, w)
                for j in range(h * w):
                    yj, xj = divmod(j, w)
                    key = K[j] + m.rel_w[xj - xi + w - 1] + m.rel_h[yj - yi + h - 1]   # equation 3
                    L[i, j] = Q[i] @ key / math.sqrt(m.dkh)
            heads.append(torch.softmax(L, -1) @ V)                                    # equation 4
        O = torch.cat(heads, -1) @ m.proj.weight[:, :, 0, 0].T                        # equation 2
        outs.append(O.T.reshape(m.dv, h, w))
    attn = torch.stack(outs)
    if m.attn_pool != 1:
        attn = F.interpolate(attn, size=(m.out_size, m.out_size), mode="bilinear", align_corners=False)
    return attn if conv is None else torch.cat([conv, attn], 1)


# -- relative logits --------------------------------------------------------------------------------
@pytest.mark.parametrize("h,w", [(5, 5), (4, 6)])
def test_efficient_relative_logits_equal_naive_computation(h, w):
    d = 3
    q, rel_h, rel_w = torch.randn(h, w, d), torch.randn(2 * h - 1, d), torch.randn(2 * w - 1, d)
    s_h, s_w = relative_logits(q, rel_h, rel_w)
    fast = (s_h[:, :, :, None] + s_w[:, :, None, :]).reshape(h * w, h * w)
    torch.testing.assert_close(fast, naive_relative_logits(q, rel_h, rel_w))
    # A chunk of query rows (row_offset) gives the matching rows of the full matrix.
    s_h2, s_w2 = relative_logits(q[2:4], rel_h, rel_w, row_offset=2, height=h)
    torch.testing.assert_close(s_h2, s_h[2:4])
    torch.testing.assert_close(s_w2, s_w[2:4])


def test_relative_logits_depend_only_on_offsets():
    # Shift the query content by t: S'[i + t, j + t] == S[i, j] for every pair inside the map.
    h = w = 6
    d, t = 4, (1, 2)
    q = torch.randn(h, w, d)
    rel_h, rel_w = torch.randn(2 * h - 1, d), torch.randn(2 * w - 1, d)
    shifted = torch.roll(q, shifts=t, dims=(0, 1))
    S = naive_relative_logits(q, rel_h, rel_w).reshape(h, w, h, w)
    s_h, s_w = relative_logits(shifted, rel_h, rel_w)
    S2 = (s_h[:, :, :, None] + s_w[:, :, None, :])
    ty, tx = t
    torch.testing.assert_close(S2[ty:, tx:, ty:, tx:], S[:h - ty, :w - tx, :h - ty, :w - tx])
    # ... which absolute position terms would break: add a per-key-position embedding.
    absolute = torch.randn(h, w)
    S_abs, S2_abs = S + absolute, S2 + absolute
    assert not torch.allclose(S2_abs[ty:, tx:, ty:, tx:], S_abs[:h - ty, :w - tx, :h - ty, :w - tx], atol=1e-3)


# -- the augmented convolution vs the slow reference ------------------------------------------------
@pytest.mark.parametrize("stride,attn_pool,impl", [(1, 1, "einsum"), (1, 1, "sdpa"), (2, 1, "einsum"),
                                                   (1, 2, "sdpa"), (2, 2, "einsum")])
def test_augmented_conv_matches_slow_reference(stride, attn_pool, impl):
    size = 6 if stride * attn_pool == 1 else 8         # the reference loops over (HW)^2 pairs
    m = AugmentedConv2d(8, 24, 3, stride, dk=16, dv=8, heads=4, feature_size=size, attn_pool=attn_pool, impl=impl)
    x = torch.randn(2, 8, size, size)
    out = m(x)
    assert out.shape == (2, 24, size // stride, size // stride)
    torch.testing.assert_close(out, slow_augmented_conv(m, x), rtol=1e-4, atol=1e-5)


def test_fully_attentional_layer_has_no_conv_part():
    m = AugmentedConv2d(8, 16, 3, 1, dk=16, dv=16, heads=4, feature_size=5)
    assert m.conv is None
    x = torch.randn(1, 8, 5, 5)
    torch.testing.assert_close(m(x), slow_augmented_conv(m, x), rtol=1e-4, atol=1e-5)


def test_chunked_checkpointed_and_sdpa_paths_agree_in_value_and_gradient():
    ref = AugmentedConv2d(8, 24, 3, 1, dk=16, dv=8, heads=4, feature_size=7, chunk_elements=None)
    x = torch.randn(2, 8, 7, 7, requires_grad=True)
    ref(x).square().sum().backward()
    g_ref, gw_ref = x.grad.clone(), ref.rel_h.grad.clone()
    for kw in ({"chunk_elements": 2 * 4 * 7 * 49}, {"chunk_elements": 1, "checkpoint": True}, {"impl": "sdpa"}):
        m = AugmentedConv2d(8, 24, 3, 1, dk=16, dv=8, heads=4, feature_size=7, **kw)
        m.load_state_dict(ref.state_dict())
        x.grad = None
        out = m(x)
        torch.testing.assert_close(out, ref(x))
        out.square().sum().backward()
        torch.testing.assert_close(x.grad, g_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(m.rel_h.grad, gw_ref, rtol=1e-4, atol=1e-5)


def test_translation_equivariance_for_content_shifted_inside_a_zero_border():
    """Content of 4x4 pixels on a zero 16x16 canvas at two placements: the outputs are shifted
    copies away from the border. Exact because (i) logits between content pixels depend only on
    offsets, (ii) zero pixels have k = v = 0 (no qkv bias), so they enter only the softmax
    denominator through exp(q_i . (r^W_dx + r^H_dy)), and (iii) with r = 0 beyond |offset| 2
    the sum of those terms over the whole canvas is the same for every query whose +-2 window
    lies inside the canvas. An absolute position encoding breaks it (checked below)."""
    n, c = 16, 4
    m = AugmentedConv2d(4, 16, 3, 1, dk=8, dv=8, heads=2, feature_size=n).eval()
    with torch.no_grad():
        for rel in (m.rel_h, m.rel_w):
            rel.mul_(3.0)                                  # make the relative terms matter
            far = (torch.arange(2 * n - 1) - (n - 1)).abs() >= 3
            rel[far] = 0.0
    content = torch.randn(1, 4, c, c)

    def place(ty, tx):
        x = torch.zeros(1, 4, n, n)
        x[:, :, ty:ty + c, tx:tx + c] = content
        return x

    (ay, ax), (by, bx) = (4, 5), (7, 6)
    out_a, out_b = m(place(ay, ax)), m(place(by, bx))
    # Compare a window around the content, 2 pixels out (outputs at zero pixels included).
    win_a = out_a[..., ay - 2:ay + c + 2, ax - 2:ax + c + 2]
    win_b = out_b[..., by - 2:by + c + 2, bx - 2:bx + c + 2]
    torch.testing.assert_close(win_a, win_b, rtol=1e-5, atol=1e-6)
    assert win_a[:, 8:].abs().max() > 1e-3             # the attention channels are not trivially zero

    # Negative control: the same layer with an absolute position code added to q, k, v.
    absolute = torch.randn(1, 2 * 8 + 8, n, n)
    handle = m.qkv.register_forward_hook(lambda mod, inp, out: out + absolute)
    out_a, out_b = m(place(ay, ax)), m(place(by, bx))
    handle.remove()
    assert not torch.allclose(out_a[..., ay - 2:ay + c + 2, ax - 2:ax + c + 2],
                              out_b[..., by - 2:by + c + 2, bx - 2:bx + c + 2], atol=1e-3)


def test_wrong_input_size_raises_a_clear_error():
    m = AugmentedConv2d(8, 16, 3, 1, dk=8, dv=8, heads=8, feature_size=14)
    with pytest.raises(ValueError, match="built for 14x14.*image_size"):
        m(torch.randn(1, 8, 16, 16))
    with pytest.raises(ValueError, match="multiples of heads"):
        AugmentedConv2d(8, 16, 3, 1, dk=12, dv=8, heads=8, feature_size=14)


def test_aa_dims_follow_kappa_upsilon_and_the_key_minimum():
    assert aa_dims(256, 0.2, 0.2, 8, 0) == (48, 48)        # 51.2 rounded to a multiple of 8
    assert aa_dims(256, 0.2, 0.2, 8, 20) == (160, 48)      # 20 key dims per head
    assert aa_dims(128, 1.0, 1.0, 8, 20) == (160, 128)     # fully attentional


def test_layer_params_follow_equation_5():
    # Delta = F_in (2 dk + dv) + dv^2 + rel - 9 F_in dv, against a plain 3x3 conv (AA eq. 5).
    fin, fout, dk, dv, size = 32, 64, 24, 16, 10
    m = AugmentedConv2d(fin, fout, 3, 1, dk=dk, dv=dv, heads=8, feature_size=size)
    conv = 9 * fin * fout
    assert count_params(m) - conv == fin * (2 * dk + dv) + dv * dv + 2 * (2 * size - 1) * (dk // 8) - 9 * fin * dv


# -- parameter counts and multiply-adds against the AA tables ---------------------------------------
def test_aa_resnet34_and_wrn28_10_params_within_2_percent_of_aa():
    r34 = model_complexity("aa_resnet34")["params"]
    assert r34 == 20_745_072
    assert abs(r34 / 1e6 / imagenet_reference()["aa_resnet34"]["params_M"] - 1) < 0.02
    cifar = reference_table("cifar100_reference").set_index("model")
    wrn = model_complexity("aa_wrn28_10", 100, "cifar")["params"]
    assert wrn == 36_312_660
    assert abs(wrn / 1e6 / cifar.loc["aa_wide_resnet_28_10", "params_M"] - 1) < 0.02


@pytest.mark.parametrize("kv,paper_m", [(0.25, 24.3), (0.5, 22.3), (0.75, 20.7), (1.0, 19.4)])
def test_aa_resnet50_ablation_counts_match_aa_table6(kv, paper_m):
    params = model_complexity("aa_resnet50", kappa=kv, upsilon=kv)["params"]
    assert abs(params / 1e6 / paper_m - 1) < 0.02


def _aa_delta(fin, fout, size, kappa=0.2, upsilon=0.2):
    dk = max(int(round(kappa * fout / 8)) * 8, 160)
    dv = int(round(upsilon * fout / 8)) * 8
    return fin * (2 * dk + dv) + dv * dv + 2 * (2 * size - 1) * (dk // 8) - 9 * fin * dv


@pytest.mark.parametrize("name,layers,pinned", [("aa_resnet50", (3, 4, 6, 3), 24_798_768),
                                               ("aa_resnet101", (3, 4, 23, 3), 43_569_896)])
def test_aa_resnet50_101_counts_pinned_and_equal_to_the_layer_formula(name, layers, pinned):
    # AA Table 3 says 25.8M / 45.4M, unreachable with the setting of Tables 1, 2, 6 (see aa.py).
    with torch.device("meta"):
        baseline = count_params(build_resnet(layers, 1000, "imagenet"))
    attn_sizes = {1: 14, 2: 14, 3: 7}                   # stage 1 attends on a pooled 14x14 map
    widths = {1: 128, 2: 256, 3: 512}
    expected = baseline + sum(layers[s] * _aa_delta(widths[s], widths[s], attn_sizes[s]) for s in (1, 2, 3))
    params = model_complexity(name)["params"]
    assert params == expected == pinned
    paper = imagenet_reference()[name]["params_M"]
    assert 0.03 < 1 - params / 1e6 / paper < 0.05      # the documented -3.9% / -4.0%


@pytest.mark.parametrize("name,resolution,num_classes,tolerance", [
    ("aa_resnet34", "imagenet", 1000, 0.10), ("aa_resnet50", "imagenet", 1000, 0.10),
    ("aa_wrn28_10", "cifar", 100, 0.15)])             # WRN: +13%, explained in aa.py
def test_multiply_adds_near_aa_tables(name, resolution, num_classes, tolerance):
    macs = model_complexity(name, num_classes, resolution)["macs"]
    print(f"{name}: ours {macs / 1e9:.2f} GMACs, paper {PAPER_MACS[name] / 1e9:.2f}")
    assert abs(macs / PAPER_MACS[name] - 1) < tolerance


def test_first_attention_stage_pools_at_imagenet_resolution_only():
    with torch.device("meta"):
        net = create_model("aa_resnet50")
    assert net.layer2[1].conv2.attn_size == 14 and net.layer3[0].conv2.attn_size == 14
    assert isinstance(net.layer1[0].conv2, nn.Conv2d)
    cifar = create_model("aa_resnet26", 10, "cifar", width=0.25)
    assert cifar.layer2[1].conv2.attn_size == 16 and cifar.layer2[1].conv2.attn_pool == 1


# -- every architecture: generic checks live in tests/test_models.py; here what is AA's own ---------
AA_MODELS = ["aa_resnet26", "aa_resnet34", "aa_resnet38", "aa_resnet50", "aa_resnet101", "aa_wrn28_10"]


@pytest.mark.parametrize("name", AA_MODELS)
def test_gradient_reaches_the_relative_embeddings(name):
    overrides = {"stem_downsample": 2} if name == "aa_wrn28_10" else {}
    model = create_model(name, num_classes=10, resolution="cifar", width=0.25, **overrides)
    for m in model.modules():          # undo the zero-init of last BNs so every branch gets gradient
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
    model(torch.rand(2, 3, 32, 32)).logsumexp(-1).sum().backward()
    relative = [p for n, p in model.named_parameters() if "rel_" in n]
    assert relative and all(p.grad.abs().sum() > 0 for p in relative)



def test_relative_embeddings_start_at_the_papers_scale():
    """AA Figure 8 (``relative_logits``) draws the relative embeddings from N(0, dkh^-1/2): the scale of
    the content logits q.k after q is scaled by dkh^-1/2, so neither term starts out dominating."""
    torch.manual_seed(0)
    layer = AugmentedConv2d(8, 80, dk=64, dv=16, heads=1, feature_size=32)      # dkh 64: std 1/8, 63 x 64 draws
    for table in (layer.rel_h, layer.rel_w):
        assert table.shape == (63, 64)
        assert table.std().item() == pytest.approx(64 ** -0.5, rel=0.05)
