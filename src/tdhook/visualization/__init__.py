"""Pictures of relevance: heatmaps of image relevance (needs matplotlib, the ``examples`` extra)."""

from tdhook.visualization.heatmap import heatmap, plot_heatmaps, save_heatmap

__all__ = ["heatmap", "plot_heatmaps", "save_heatmap"]
