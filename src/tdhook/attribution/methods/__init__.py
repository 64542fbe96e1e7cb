"""Attribution methods other than LRP, each a TensorDict module with LRP's constructor conventions.

Every method writes its attribution of input key ``k`` at ``(relevance_key, *k)``
(``relevance_key="attribution"`` by default), with the input's shape, next to
the model's outputs.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictModule
    >>> from tdhook.attribution import IntegratedGradients
    >>> policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["observation"], out_keys=["action_value"])
    >>> td = IntegratedGradients(policy, n_steps=8)(TensorDict(observation=torch.randn(4, 3), batch_size=[4]))
    >>> td["attribution", "observation"].shape
    torch.Size([4, 3])
"""

from tdhook.attribution.methods.feature_ablation import FeatureAblation
from tdhook.attribution.methods.grad_cam import GradCAM
from tdhook.attribution.methods.gradient_shap import GradientShap
from tdhook.attribution.methods.guided_backprop import GuidedBackprop
from tdhook.attribution.methods.input_x_gradient import InputXGradient
from tdhook.attribution.methods.integrated_gradients import IntegratedGradients
from tdhook.attribution.methods.occlusion import Occlusion
from tdhook.attribution.methods.saliency import Saliency
from tdhook.attribution.methods.shapley import ShapleyValueSampling
from tdhook.attribution.methods.smooth_grad import SmoothGrad

__all__ = [
    "FeatureAblation",
    "GradCAM",
    "GradientShap",
    "GuidedBackprop",
    "InputXGradient",
    "IntegratedGradients",
    "Occlusion",
    "Saliency",
    "ShapleyValueSampling",
    "SmoothGrad",
]
