"""fast_model folds the conv -> batch-norm pairs a module declares in ``foldable_conv_bn`` (here
External Attention's output projection), also where fx cannot trace the module, and leaves the
caller's model unchanged."""
import torch
import torch.nn as nn

from robust_attn.attacks.fast_model import fold_batchnorm
from robust_attn.layers.external_attention import ExternalAttention


def _ea(seed: int) -> ExternalAttention:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = ExternalAttention(8, slots=6, heads=2, expansion=2)
    with torch.no_grad():
        layer.bn.running_mean.copy_(torch.randn(8, generator=gen))
        layer.bn.running_var.copy_(torch.rand(8, generator=gen) + 0.5)
        layer.bn.weight.copy_(torch.rand(8, generator=gen) + 0.5)
        layer.bn.bias.copy_(torch.randn(8, generator=gen))
    return layer.eval()


class _Untraceable(nn.Module):
    """A forward fx cannot trace (a branch on the data) around an External Attention block."""

    def __init__(self):
        super().__init__()
        self.ea = _ea(1)

    def forward(self, x):
        return self.ea(x) if x.sum() > 0 else -self.ea(-x)


def test_declared_pair_is_folded_in_an_untraceable_model_and_the_original_is_kept():
    model = _Untraceable().eval()
    folded, count = fold_batchnorm(model)
    assert count == 1 and folded is not model
    assert isinstance(folded.ea.bn, nn.Identity) and isinstance(model.ea.bn, nn.BatchNorm2d)
    assert folded.ea.conv_out.bias is not None and model.ea.conv_out.bias is None
    for sign in (1.0, -1.0):
        x = sign * torch.rand(2, 8, 5, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_training_mode_batch_norm_is_not_folded():
    model = nn.Sequential(_ea(3))
    model.eval()
    model[0].bn.train()
    folded, count = fold_batchnorm(model)
    assert count == 0 and folded is model
