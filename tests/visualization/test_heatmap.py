"""Heatmaps put the sign of relevance on the right side of the colour map and save real PNGs."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.image import imread
from tensordict import TensorDict

from tdhook.visualization import heatmap, plot_heatmaps, save_heatmap

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RED, BLUE, WHITE = [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]


def test_positive_is_red_negative_is_blue_zero_is_white():
    rgb = heatmap(torch.tensor([[3.0, -3.0, 0.0]]))
    np.testing.assert_allclose(rgb[0, 0], RED, atol=0.01)
    np.testing.assert_allclose(rgb[0, 1], BLUE, atol=0.01)
    np.testing.assert_allclose(rgb[0, 2], WHITE, atol=0.01)


def test_output_is_float_rgb_in_unit_range():
    rgb = heatmap(torch.randn(3, 7, 5) * 1e3)
    assert rgb.shape == (7, 5, 3)
    assert rgb.dtype.kind == "f"
    assert rgb.min() >= 0.0 and rgb.max() <= 1.0


def test_all_zero_relevance_is_the_centre_colour_without_nan():
    rgb = heatmap(torch.zeros(3, 4, 4))
    assert np.isfinite(rgb).all()
    centre = np.asarray(matplotlib.colormaps["bwr"](0.5)[:3])
    np.testing.assert_allclose(rgb, np.broadcast_to(centre, rgb.shape))
    np.testing.assert_allclose(rgb, np.broadcast_to(WHITE, rgb.shape), atol=0.01)


def test_range_is_symmetric_so_negated_relevance_gives_mirrored_colours():
    torch.manual_seed(1)
    relevance = torch.randn(3, 6, 6) + 0.7  # mostly positive: a min-max range would not be symmetric
    rgb, mirrored = heatmap(relevance), heatmap(-relevance)
    # bwr is red-blue symmetric: mirroring the sign swaps the red and blue channels
    np.testing.assert_allclose(rgb[..., 0], mirrored[..., 2], atol=0.01)
    np.testing.assert_allclose(rgb[..., 2], mirrored[..., 0], atol=0.01)
    np.testing.assert_allclose(rgb[..., 1], mirrored[..., 1], atol=0.01)


def test_scale_is_max_abs_and_level_raises_contrast():
    relevance = torch.tensor([[4.0, 1.0, -2.0]])
    bwr = matplotlib.colormaps["bwr"]
    np.testing.assert_allclose(heatmap(relevance)[0, 1], bwr(0.5 + 0.5 * 1 / 4)[:3])
    np.testing.assert_allclose(heatmap(relevance)[0, 2], bwr(0.5 - 0.5 * 2 / 4)[:3])
    brighter = heatmap(relevance, level=2.0)  # vmax = 2: the 4 saturates, the 1 maps to a quarter
    np.testing.assert_allclose(brighter[0, 0], bwr(1.0)[:3])
    np.testing.assert_allclose(brighter[0, 1], bwr(0.75)[:3])
    np.testing.assert_allclose(brighter[0, 2], bwr(0.0)[:3])


def test_channels_are_summed_with_sign():
    relevance = torch.zeros(3, 1, 2)
    relevance[0, 0, 0], relevance[1, 0, 0] = 1.0, -1.0  # cancels out
    relevance[:, 0, 1] = 1.0
    rgb = heatmap(relevance)
    np.testing.assert_allclose(rgb[0, 0], WHITE, atol=0.01)
    np.testing.assert_allclose(rgb[0, 1], RED, atol=0.01)
    np.testing.assert_allclose(heatmap(relevance, channel_reduction="abs_sum")[0, 0], [1.0, 1 / 3, 1 / 3], atol=0.01)


def test_batch_of_one_channels_first_and_two_dims_agree():
    relevance = torch.randn(1, 3, 5, 6)
    # Summed in float64, as heatmap sums the channels: a float32 sum could move a pixel across a colour-map bin.
    expected = heatmap(relevance.double().sum(1)[0])
    np.testing.assert_allclose(heatmap(relevance), expected)
    np.testing.assert_allclose(heatmap(relevance[0]), expected)


def test_other_colour_maps_are_used():
    rgb = heatmap(torch.tensor([[1.0, -1.0]]), cmap="coolwarm")
    coolwarm = matplotlib.colormaps["coolwarm"]
    np.testing.assert_allclose(rgb[0, 0], coolwarm(1.0)[:3])
    np.testing.assert_allclose(rgb[0, 1], coolwarm(0.0)[:3])


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((5,), r"got shape \(5,\)"), ((1, 1, 3, 4, 4), r"got shape \(1, 1, 3, 4, 4\)"), ((2, 3, 4, 4), "batch of 2")],
)
def test_wrong_shapes_say_what_was_received_and_expected(shape, expected):
    with pytest.raises(ValueError, match=expected) as info:
        heatmap(torch.ones(shape))
    assert "(C, H, W)" in str(info.value) or "one sample" in str(info.value)


def test_a_tensordict_in_place_of_the_relevance_names_its_keys_and_the_entry_to_read(tmp_path: Path):
    """Before, torch.as_tensor made an empty tensor of it: "max(): Expected reduction dim to be specified ..."."""
    relevance = TensorDict(image=torch.randn(2, 3, 4, 4), batch_size=[2])
    td = TensorDict(image=torch.randn(2, 3, 4, 4), logits=torch.randn(2, 5), relevance=relevance, batch_size=[2])
    keys = re.escape("['image', 'logits', ('relevance', 'image')]")
    with pytest.raises(TypeError, match=rf"got a TensorDict with keys {keys}; .* td\['relevance', 'image'\]\[0\]$"):
        heatmap(td)
    with pytest.raises(TypeError, match=r"e\.g\. td\['relevance', 'image'\]$"):  # a batch of relevance, as given
        plot_heatmaps(td["image"], td, tmp_path / "figure.png")
    assert not list(tmp_path.iterdir())


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="channel_reduction"):
        heatmap(torch.ones(4, 4), channel_reduction="max")
    with pytest.raises(ValueError, match="level"):
        heatmap(torch.ones(4, 4), level=0.0)
    with pytest.raises(ValueError, match="no-such-map"):
        heatmap(torch.ones(4, 4), cmap="no-such-map")
    with pytest.raises(ValueError, match="NaN"):
        heatmap(torch.tensor([[1.0, float("nan")]]))


def test_gradients_and_float64_are_accepted():
    relevance = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert heatmap(relevance * 2).shape == (4, 4, 3)


def test_save_heatmap_writes_a_png_of_the_input_size(tmp_path: Path):
    relevance = torch.zeros(3, 12, 20)
    relevance[:, :, :10] = 1.0
    relevance[:, :, 10:] = -1.0
    path = save_heatmap(relevance, tmp_path / "nested" / "heatmap.png")
    assert path == tmp_path / "nested" / "heatmap.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    pixels = imread(path)
    assert pixels.shape[:2] == (12, 20)
    np.testing.assert_allclose(pixels[0, 0, :3], RED, atol=0.01)
    np.testing.assert_allclose(pixels[-1, -1, :3], BLUE, atol=0.01)


def test_save_heatmap_passes_options_on(tmp_path: Path):
    path = save_heatmap(torch.tensor([[1.0, 0.0]]), str(tmp_path / "grey.png"), cmap="gray")
    assert isinstance(path, Path)
    np.testing.assert_allclose(imread(path)[0, :, :3], [[1.0] * 3, [0.5] * 3], atol=0.01)


def test_plot_heatmaps_writes_a_png_figure(tmp_path: Path):
    images, relevances = torch.rand(2, 3, 16, 16), torch.randn(2, 3, 16, 16)
    path = plot_heatmaps(images, relevances, tmp_path / "figure.png", titles=["first", "second"])
    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width = imread(path).shape[:2]
    assert height > width  # two rows of two panels


def test_plot_heatmaps_checks_its_inputs(tmp_path: Path):
    with pytest.raises(ValueError, match="as many images as relevances"):
        plot_heatmaps(torch.rand(2, 3, 8, 8), torch.rand(1, 3, 8, 8), tmp_path / "f.png")
    with pytest.raises(ValueError, match="titles"):
        plot_heatmaps(torch.rand(1, 3, 8, 8), torch.rand(1, 3, 8, 8), tmp_path / "f.png", titles=["a", "b"])
    with pytest.raises(ValueError, match=r"got \(5, 8, 8\)"):
        plot_heatmaps([torch.rand(5, 8, 8)], [torch.rand(5, 8, 8)], tmp_path / "f.png")
