"""5-point similarity alignment: landmarks → a chip on a fixed template, as an exportable graph.

`fit_similarity` / `chip_transform` (kiln_runtime/align.py: a deployment host fits the same way) solve the similarity
that maps template points onto the detected landmarks; `Aligner` is the warp itself — `affine_grid`-style sampling
grid + `grid_sample` (bilinear) — so it exports to ONNX (GridSample, opset ≥ 16) and compiles like any other graph.

Coordinates are pixel centres: chip pixel (u, v) samples the image at `M @ [u, v, 1]`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kiln_runtime.align import chip_transform, fit_similarity  # noqa: F401 — the numpy half lives in the runtime


def jitter(size: int, rotation_deg: float, scale: float, shift_x: float, shift_y: float) -> np.ndarray:
    """A 3×3 similarity on chip coordinates about the chip centre: rotate, zoom by (1+scale), shift (pixels)."""
    c = (size - 1) / 2.0
    th = np.deg2rad(rotation_deg)
    s = 1.0 + scale
    r = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]]) / s
    m = np.eye(3)
    m[:2, :2] = r
    m[:2, 2] = np.array([c, c]) - r @ np.array([c, c]) + np.array([shift_x, shift_y])
    return m


class Aligner(nn.Module):
    """image (1, 3, H, W) float, theta (N, 2, 3) chip→image pixel transforms → chips (N, 3, S, S).

    Bilinear sampling, border padding. The sampling grid is built inside the graph so H and W may vary.
    """

    def __init__(self, size: int) -> None:
        super().__init__()
        v, u = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                              indexing="ij")
        self.size = size
        self.register_buffer("base", torch.stack([u, v, torch.ones_like(u)], -1).reshape(1, size * size, 3))

    def forward(self, image: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        n = theta.shape[0]
        pts = torch.matmul(self.base, theta.transpose(1, 2))             # (N, S*S, 2) image pixel coords
        # pixel centres → [-1, 1] (align_corners=False); sizes stay symbolic for both exporters
        gx = (2.0 * pts[..., :1] + 1.0) / image.shape[3] - 1.0
        gy = (2.0 * pts[..., 1:] + 1.0) / image.shape[2] - 1.0
        grid = torch.cat([gx, gy], -1)
        grid = grid.reshape(n, self.size, self.size, 2)
        return F.grid_sample(image.expand(n, -1, -1, -1), grid, mode="bilinear", padding_mode="border",
                             align_corners=False)


class AlignerGraph(Aligner):
    """The exported aligner: inputs named `image` and `theta`, output `chips`."""

    output_names = ("chips",)


def build_aligner(size: int = 150) -> AlignerGraph:
    return AlignerGraph(size)


def align(rgb: np.ndarray, thetas: np.ndarray, size: int, aligner: Aligner | None = None) -> np.ndarray:
    """Warp an HWC uint8 image into N chips (N, S, S, 3) float32 in 0..255 with the reference (PyTorch) graph."""
    aligner = aligner or Aligner(size)
    img = torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1))).float().unsqueeze(0)
    with torch.no_grad():
        chips = aligner(img, torch.from_numpy(np.asarray(thetas, np.float32)))
    return chips.permute(0, 2, 3, 1).numpy()
