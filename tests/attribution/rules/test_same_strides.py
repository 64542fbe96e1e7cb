"""The rules' views of a tensor keep its strides, so that the model's outputs stay bit for bit its own."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tdhook.attribution import LRP, AttnLRP


def test_a_fused_attention_under_attnlrp_gives_the_plain_calls_values_bit_for_bit():
    """The uniform rule's factors on a fused attention's query, key and value were views with strides of their own in
    the dimensions of size 1 (``view_as``): on timm's ``cpubone_nano``, whose ConvAttention attends over one token
    from 32 pixels, the attention laid its output out otherwise, the convolution after it returned a channels-last
    tensor, and the group norm after that summed in another order: the logits 1.1e-15 off the plain call's
    (float64), under AttnLRP alone. The views keep the strides now."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("cpubone_nano", pretrained=False, num_classes=5).double().eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        plain = model(x)
    lrp = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"])
    assert torch.equal(lrp(TensorDict(x=x, batch_size=[2]))["y"], plain)
