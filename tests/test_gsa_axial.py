"""GSA's axial positional attention in the factored order (robust_attn.layers.gsa_axial) against the
paper's order (Eq. 2 written out as loops here), values and gradients, and the module's choice of
order by path."""
import pytest
import torch

from robust_attn.layers.gsa import GlobalSelfAttention2d, relative_to_absolute
from robust_attn.layers.gsa_axial import axial_positional_attention_factored, factored_is_cheaper
from robust_attn.layers.paths import set_attention_path


def _eq2_loops(q, v, pos, axis):
    """``out[x, y] = sum_i (q_xy . P[x, i]) v[i, y]`` (column) or ``sum_j (q_xy . P[y, j]) v[x, j]`` (row)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], q.shape[3], q.shape[4], dtype=q.dtype)
    for x in range(q.shape[3]):
        for y in range(q.shape[4]):
            if axis == "column":
                w = torch.einsum("bnk,ik->bni", q[..., x, y], pos[x])
                out[..., x, y] = torch.einsum("bni,bnvi->bnv", w, v[..., :, y])
            else:
                w = torch.einsum("bnk,jk->bnj", q[..., x, y], pos[y])
                out[..., x, y] = torch.einsum("bnj,bnvj->bnv", w, v[..., x, :])
    return out


@pytest.mark.parametrize("axis", ["column", "row"])
@pytest.mark.parametrize("dk,dv", [(2, 2), (3, 5)])
def test_factored_order_is_eq2(axis, dk, dv):
    torch.manual_seed(0)
    h, w = 5, 4
    length = h if axis == "column" else w
    q = torch.randn(2, 3, dk, h, w, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, dv, h, w, dtype=torch.float64, requires_grad=True)
    rel = torch.randn(2 * 6 - 1, dk, dtype=torch.float64, requires_grad=True)     # built for L = 6 > 5
    fn = lambda q, v, rel: axial_positional_attention_factored(q, v, relative_to_absolute(rel, length), axis)
    torch.testing.assert_close(fn(q, v, rel), _eq2_loops(q, v, relative_to_absolute(rel, length), axis))
    assert torch.autograd.gradcheck(fn, (q, v, rel))


def test_module_takes_the_factored_order_on_its_lean_path_where_cheaper(monkeypatch):
    torch.manual_seed(1)
    layer = GlobalSelfAttention2d(16, 16, feature_size=8, heads=8).double().eval()   # 2 channels per head
    assert factored_is_cheaper(2, 2, 8) and not factored_is_cheaper(16, 16, 4)
    x = torch.randn(2, 16, 8, 8, dtype=torch.float64, requires_grad=True)
    calls = []
    import robust_attn.layers.gsa as gsa
    original = gsa.axial_positional_attention_factored
    monkeypatch.setattr(gsa, "axial_positional_attention_factored", lambda *a: calls.append(1) or original(*a))
    lean = layer(x)
    assert len(calls) == 2                                                  # column and row
    assert set_attention_path(layer, "reference") == 1
    reference = layer(x)
    assert len(calls) == 2
    torch.testing.assert_close(lean, reference, rtol=1e-10, atol=1e-12)
    g_lean, = torch.autograd.grad(lean.square().sum(), x)
    g_ref, = torch.autograd.grad(reference.square().sum(), x)
    torch.testing.assert_close(g_lean, g_ref, rtol=1e-10, atol=1e-12)
