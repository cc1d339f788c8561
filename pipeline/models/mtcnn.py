"""MTCNN face detector (Zhang et al. 2016): the P-, R- and O-Net graphs.

The nets are small torch modules that load facenet-pytorch 2.6.0's state dicts (MIT) unchanged; each exports to
ONNX on its own. The cascade around them (pyramid, crops, box maths, NMS: "the glue") is numpy and lives in the
runtime (kiln_runtime/mtcnn.py), so the build's gates and a deployment host run the same detector code; it talks
to the nets only through a ``Runner`` (numpy in, tuple of numpy out): engines, or these modules via
``torch_runner``.

Net outputs, in this order (same as facenet-pytorch):
    PNet  (N,3,H,W)   -> bbox_reg (N,4,H',W'), prob (N,2,H',W')      H' = ceil((H-2)/2) - 4
    RNet  (N,3,24,24) -> bbox_reg (N,4), prob (N,2)
    ONet  (N,3,48,48) -> bbox_reg (N,4), landmarks (N,10), prob (N,2)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from kiln_runtime import mtcnn as _glue
from kiln_runtime.mtcnn import DetectorConfig, Face, Runner, nms, preprocess, pyramid_scales  # noqa: F401


def _conv(cin: int, cout: int, k: int) -> tuple[nn.Conv2d, nn.PReLU]:
    return nn.Conv2d(cin, cout, kernel_size=k), nn.PReLU(cout)


def _tf_flatten(x: torch.Tensor) -> torch.Tensor:
    # The weights come from TensorFlow, whose dense layers see features in (W, H, C) order.
    return x.permute(0, 3, 2, 1).flatten(1)


class PNet(nn.Module):
    """Proposal net, fully convolutional (12x12 receptive field, stride 2). 6,632 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.prelu1 = _conv(3, 10, 3)
        self.pool1 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv2, self.prelu2 = _conv(10, 16, 3)
        self.conv3, self.prelu3 = _conv(16, 32, 3)
        self.conv4_1 = nn.Conv2d(32, 2, kernel_size=1)
        self.conv4_2 = nn.Conv2d(32, 4, kernel_size=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.prelu3(self.conv3(self.prelu2(self.conv2(x))))
        return self.conv4_2(x), torch.softmax(self.conv4_1(x), dim=1)


class RNet(nn.Module):
    """Refinement net on 24x24 crops. 100,178 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.prelu1 = _conv(3, 28, 3)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = _conv(28, 48, 3)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = _conv(48, 64, 2)
        self.dense4, self.prelu4 = nn.Linear(576, 128), nn.PReLU(128)
        self.dense5_1 = nn.Linear(128, 2)
        self.dense5_2 = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.prelu3(self.conv3(x))
        x = self.prelu4(self.dense4(_tf_flatten(x)))
        return self.dense5_2(x), torch.softmax(self.dense5_1(x), dim=1)


class ONet(nn.Module):
    """Output net on 48x48 crops: box, 5 landmarks, score. 389,040 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.prelu1 = _conv(3, 32, 3)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = _conv(32, 64, 3)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = _conv(64, 64, 3)
        self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv4, self.prelu4 = _conv(64, 128, 2)
        self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
        self.dense6_1 = nn.Linear(256, 2)
        self.dense6_2 = nn.Linear(256, 4)
        self.dense6_3 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.pool1(self.prelu1(self.conv1(x)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.pool3(self.prelu3(self.conv3(x)))
        x = self.prelu4(self.conv4(x))
        x = self.prelu5(self.dense5(_tf_flatten(x)))
        return self.dense6_2(x), self.dense6_3(x), torch.softmax(self.dense6_1(x), dim=1)


def load_nets(pnet_pt: str | Path, rnet_pt: str | Path, onet_pt: str | Path) -> tuple[PNet, RNet, ONet]:
    """Build the three nets from their state dicts (strict) and put them in eval mode."""
    return build_pnet(pnet_pt), build_rnet(rnet_pt), build_onet(onet_pt)


def torch_runner(module: nn.Module) -> Runner:
    """Wrap a net as a numpy-in, numpy-out callable (eval mode, no autograd)."""
    module.eval()

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        with torch.inference_mode():
            out = module(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)))
        return tuple(o.numpy() for o in out)

    return run


def detect(rgb: np.ndarray, pnet: Runner | nn.Module, rnet: Runner | nn.Module, onet: Runner | nn.Module,
           cfg: DetectorConfig = DetectorConfig()) -> list[Face]:
    """The runtime's cascade (kiln_runtime.mtcnn.detect) over runners or these torch modules."""
    return _glue.detect(rgb, *(torch_runner(n) if isinstance(n, nn.Module) else n for n in (pnet, rnet, onet)), cfg)


# Factories named in params.yaml (`models.<net>.factory`): one exportable graph each, outputs named for ONNX.
PNet.output_names = ("bbox_reg", "prob")
RNet.output_names = ("bbox_reg", "prob")
ONet.output_names = ("bbox_reg", "landmarks", "prob")


def _build(cls: type[nn.Module], weights: str | Path) -> nn.Module:
    net = cls()
    net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True), strict=True)
    return net.eval()


def build_pnet(weights: str | Path) -> PNet:
    return _build(PNet, weights)


def build_rnet(weights: str | Path) -> RNet:
    return _build(RNet, weights)


def build_onet(weights: str | Path) -> ONet:
    return _build(ONet, weights)
