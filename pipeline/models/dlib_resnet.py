"""dlib's `dlib_face_recognition_resnet_model_v1` as a PyTorch module, read straight from dlib's `.dat` file.

The network (dlib's dnn_face_recognition_ex.cpp, innermost template = first applied) is

    input_rgb_image_sized<150>  ->  con 32 7x7/2  affine relu  max_pool 3x3/2
    -> 14 residual blocks (table `BLOCKS`) -> avg_pool_everything -> fc_no_bias 128   (loss_metric on top)

A block is `relu(shortcut(x) + affine(con3x3/1(relu(affine(con3x3/s(x))))))`. Plain blocks have s=1 and an
identity shortcut; "down" blocks have s=2 and `avg_pool 2x2/2` as shortcut, and dlib's `add_prev` adds tensors of
different shapes by zero-padding both to the larger channels/rows/cols (aligned at channel 0, top-left).
Padding is `k/2` for stride 1 and 0 otherwise, sizes floor `1 + (n + 2p - k) / s`: 150 72 35 17 8 4 2 1.

File format (dlib/serialize.h, dlib/dnn/{core,layers,input,loss}.h):
  * integers: one control byte (low nibble = byte count, 0x80 = negative) + that many little-endian bytes;
  * float/double: integer mantissa m, integer exponent e, value m * 2**e;  bool: ASCII '0'/'1';
  * string: integer length + bytes;  tensor: int 2, 4 dims (n, k, nr, nc), raw little-endian float32 data;
    alias_tensor (a view into a layer's `params`): int 1 + 4 dims.
  * net: `add_loss_layer` = int 1, loss details, subnet.  `add_layer` = int 2, subnet, details, 3 bools and
    3 tensors (x_grad, cached_output, params_grad); tag and skip layers = int 1, subnet.  The innermost add_layer
    is int 2|3, input-layer details, details, 3 bools, 3 tensors [, int sample_expansion_factor if 3].
    Subnets come first, so layer details appear in forward order; each starts with its type string ("con_4").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import KilnError

DAT_NAME = "dlib_face_recognition_resnet_model_v1.dat"
DAT_SHA256 = "55533b28a95800a551ba546ba62fe69625c7e95a7061c338adffead08719da30"
INPUT_SIZE = 150
EMBED_DIM = 128
#: (channels, down) per residual block, in forward order (alevel4 .. alevel0).
BLOCKS: tuple[tuple[int, bool], ...] = (
    ((32, False),) * 3 + ((64, True),) + ((64, False),) * 3 + ((128, True),) + ((128, False),) * 2
    + ((256, True),) + ((256, False),) * 2 + ((256, True),))


class DatFormatError(KilnError):
    """The `.dat` file is not the dlib face-recognition ResNet this module reproduces (truncated, foreign, ...)."""


@dataclass
class DlibWeights:
    """Everything read from the file. Arrays are float32; convs/affines are in forward order."""

    convs: list[tuple[np.ndarray, np.ndarray | None, int]]  # (weight [out,in,kh,kw], bias [out], stride)
    affines: list[tuple[np.ndarray, np.ndarray]]  # (gamma [C], beta [C]): y = gamma * x + beta
    fc: np.ndarray  # [128, 256], torch Linear layout (dlib stores [256, 128] and computes x @ W)
    input_mean: tuple[float, float, float]  # per-RGB-plane average subtracted before dividing by 256
    dist_thresh: float  # loss_metric's same-person distance threshold
    margin: float = 0.0  # loss_metric's training margin
    layers: list[str] = field(default_factory=list)  # forward-order layer kinds as read, for diagnostics


def _conv_spec(cout: int, cin: int, k: int, s: int) -> tuple[int, ...]:
    p = k // 2 if s == 1 else 0
    return (cout, cin, k, k, s, s, p, p)


def _expected_layers() -> list[tuple[str, tuple[int, ...]]]:
    """The (kind, spec) sequence the file must contain, in forward order; "tag" stands for a tag or skip layer."""
    seq = [("con", _conv_spec(32, 3, 7, 2)), ("affine", (32,)), ("relu", ()), ("max_pool", (3, 3, 2, 2, 0, 0))]
    cin = 32
    for c, down in BLOCKS:
        seq += [("tag", ()), ("con", _conv_spec(c, cin, 3, 2 if down else 1)), ("affine", (c,)), ("relu", ()),
                ("con", _conv_spec(c, c, 3, 1)), ("affine", (c,))]
        if down:
            seq += [("tag", ()), ("tag", ()), ("avg_pool", (2, 2, 2, 2, 0, 0))]
        seq += [("add_prev", ()), ("relu", ())]
        cin = c
    return seq + [("avg_pool", (0, 0, 1, 1, 0, 0)), ("fc", (EMBED_DIM, cin))]


class _Stream:
    """Cursor over the file's bytes; every read checks bounds and fails with a DatFormatError naming the file."""

    def __init__(self, data: bytes, path: Path) -> None:
        self.data, self.view, self.pos, self.path = data, memoryview(data), 0, path

    def fail(self, what: str) -> NoReturn:
        raise DatFormatError(
            f"{self.path} is not a valid {DAT_NAME} (expected dlib's serialized face-recognition ResNet): "
            f"{what} (at byte {self.pos} of {len(self.data)})",
            f"re-run `kiln assets` to fetch it again; its sha256 must be {DAT_SHA256}")

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.data) - self.pos:
            self.fail(f"file ends early while reading {what} (truncated?)")
        self.pos += n
        return self.view[self.pos - n:self.pos]

    def int(self, what: str) -> int:
        ctrl = self.take(1, what)[0]
        if ctrl & 0x70 or (ctrl & 0x0F) > 8:
            self.pos -= 1
            self.fail(f"bad integer control byte 0x{ctrl:02x} in {what}")
        value = int.from_bytes(self.take(ctrl & 0x0F, what), "little")
        return -value if ctrl & 0x80 else value

    def expect(self, allowed: tuple, found, what: str):
        if found not in allowed:
            self.fail(f"{what} is {found!r}, expected {' or '.join(map(repr, allowed))}")
        return found

    def float(self, what: str) -> float:
        mantissa, exponent = self.int(what), self.int(what)
        if exponent in (32000, 32001, 32002) or abs(exponent) > 1100:
            self.fail(f"non-finite or out-of-range {what}")
        return math.ldexp(mantissa, exponent)

    def bool(self, what: str) -> bool:
        return self.expect((b"0", b"1"), bytes(self.take(1, what)), what) == b"1"

    def string(self, what: str) -> str:
        n = self.int(what)
        if not 0 <= n <= 256:
            self.fail(f"implausible string length {n} in {what}")
        try:
            return bytes(self.take(n, what)).decode("ascii")
        except UnicodeDecodeError:
            self.fail(f"{what} is not ASCII")

    def at_string(self, prefix: str) -> bool:
        """True if a string starting with `prefix` comes next (peeks; does not move)."""
        head = self.data[self.pos:self.pos + 2 + len(prefix)]  # control byte 0x01, length, text
        return head[:1] == b"\x01" and head[2:] == prefix.encode()

    def dims(self, what: str) -> tuple[int, ...]:
        shape = tuple(self.int(what) for _ in range(4))
        if min(shape) < 0:
            self.fail(f"negative dimension in {what}: {shape}")
        return shape

    def tensor(self, what: str) -> np.ndarray:
        self.expect((2,), self.int(what), f"{what} tensor version")
        shape = self.dims(what)
        raw = self.take(4 * math.prod(shape), what)
        return np.frombuffer(raw, dtype="<f4").astype(np.float32).reshape(shape)

    def alias(self, what: str) -> tuple[int, ...]:
        self.expect((1,), self.int(what), f"{what} alias_tensor version")
        return self.dims(what)


def _read_details(s: _Stream) -> tuple[str, tuple[int, ...], tuple[np.ndarray, ...]]:
    """One layer's details: (kind, spec comparable with `_expected_layers`, parameter arrays)."""
    name = s.string("layer type")
    if name == "con_4":
        params = s.tensor("con_ params").ravel()
        nf, *geom = (s.int("con_ geometry") for _ in range(7))  # filters, nr, nc, stride y/x, padding y/x
        filt, bias = s.alias("con_ filters"), s.alias("con_ biases")
        for what in ("learning_rate", "weight_decay", "bias_learning_rate", "bias_weight_decay"):
            s.float(f"con_ {what}_multiplier")
        n = math.prod(filt)
        if filt[0] != nf or filt[2:] != tuple(geom[:2]) or bias != (1, nf, 1, 1) or params.size != n + nf:
            s.fail(f"con_ params of size {params.size} do not match filters {filt} + biases {bias}")
        return "con", (nf, filt[1], *geom), (params[:n].reshape(filt), params[n:])
    if name == "affine_":
        params = s.tensor("affine_ params").ravel()
        gamma, beta = s.alias("affine_ gamma"), s.alias("affine_ beta")
        s.expect((0,), s.int("affine_ mode"), "affine_ mode (0 = per-channel CONV_MODE)")
        c = gamma[1]
        if gamma != beta or gamma != (1, c, 1, 1) or params.size != 2 * c:
            s.fail(f"affine_ params of size {params.size} do not match gamma {gamma} + beta {beta}")
        return "affine", (c,), (params[:c], params[c:])
    if name in ("max_pool_2", "avg_pool_2"):
        return name[:-2], tuple(s.int(f"{name} geometry") for _ in range(6)), ()
    if name in ("relu_", "add_prev_"):
        return name[:-1], (), ()
    if name == "fc_2":
        n_out, n_in = s.int("fc_ num_outputs"), s.int("fc_ num_inputs")
        params, weights, biases = s.tensor("fc_ params").ravel(), s.alias("fc_ weights"), s.alias("fc_ biases")
        s.expect((1,), s.int("fc_ bias_mode"), "fc_ bias_mode (1 = FC_NO_BIAS)")
        for what in ("learning_rate", "weight_decay", "bias_learning_rate", "bias_weight_decay"):
            s.float(f"fc_ {what}_multiplier")
        if weights != (n_in, n_out, 1, 1) or biases != (0, 0, 0, 0) or params.size != n_in * n_out:
            s.fail(f"fc_ params of size {params.size} do not match weights {weights} (biases {biases})")
        return "fc", (n_out, n_in), (params.reshape(n_in, n_out).T.copy(),)
    s.fail(f"unsupported layer type {name!r}")


def _read_layer_trailer(s: _Stream, version: int) -> None:
    """The add_layer fields after the details: 3 bools, 3 scratch tensors [, sample_expansion_factor]."""
    for what in ("this_layer_setup_called", "gradient_input_is_stale", "get_output_and_gradient_input_disabled"):
        s.bool(what)
    for what in ("x_grad", "cached_output", "params_grad"):
        s.tensor(what)
    if version == 3:
        s.int("sample_expansion_factor")


def read_dat(path: Path) -> DlibWeights:
    """Parse dlib's `.dat`, check every layer against the architecture, and return the weights."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DatFormatError(f"cannot read {path}: {e.strerror}", "run `kiln assets` to fetch it") from e
    s = _Stream(data, path)
    s.expect((1,), s.int("add_loss_layer version"), "add_loss_layer version")
    s.expect(("loss_metric_2",), s.string("loss layer type"), "loss layer type")
    margin, dist_thresh = s.float("loss_metric_ margin"), s.float("loss_metric_ dist_thresh")

    wrappers = []  # outermost first: True for add_layer (details follow its subnet), False for tag/skip
    while True:
        version = s.int("layer version")
        if s.at_string("input"):
            s.expect((2, 3), version, "innermost add_layer version")
            break
        wrappers.append(s.expect((1, 2), version, "add_layer/tag/skip version") == 2)
    s.expect(("input_rgb_image_sized",), s.string("input layer type"), "input layer type")
    mean = tuple(s.float("input_rgb_image_sized average") for _ in range(3))
    s.expect(((INPUT_SIZE, INPUT_SIZE),), (s.int("input rows"), s.int("input cols")), "input size")
    layers = [_read_details(s)]
    _read_layer_trailer(s, version)
    for is_layer in reversed(wrappers):
        if is_layer:
            layers.append(_read_details(s))
            _read_layer_trailer(s, 2)
        else:
            layers.append(("tag", (), ()))
    if s.pos != len(data):
        s.fail(f"{len(data) - s.pos} unexpected trailing bytes after the network")

    expected = _expected_layers()
    for i, ((kind, spec, _), want) in enumerate(zip(layers, expected)):
        if (kind, spec) != want:
            s.fail(f"layer {i} is {kind}{spec}, expected {want[0]}{want[1]}")
    if len(layers) != len(expected):
        s.fail(f"found {len(layers)} layers, expected {len(expected)}")
    return DlibWeights(
        convs=[(a[0], a[1], spec[4]) for kind, spec, a in layers if kind == "con"],
        affines=[a for kind, _, a in layers if kind == "affine"],
        fc=next(a[0] for kind, _, a in layers if kind == "fc"),
        input_mean=mean, dist_thresh=dist_thresh, margin=margin, layers=[kind for kind, _, _ in layers])


class _Affine(nn.Module):
    """dlib's `affine` layer in CONV_MODE: a frozen per-channel `gamma * x + beta` (batch norm folded)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.view(1, -1, 1, 1) + self.beta.view(1, -1, 1, 1)


def _size(n: int, k: int, s: int, p: int = 0) -> int:
    return 1 + (n + 2 * p - k) // s


class _Block(nn.Module):
    """dlib's `ares` (down=False) or `ares_down` (down=True) residual block for a static input size."""

    def __init__(self, cin: int, cout: int, down: bool, size: int) -> None:
        super().__init__()
        s = 2 if down else 1
        self.conv1, self.affine1 = nn.Conv2d(cin, cout, 3, s, 1 if s == 1 else 0), _Affine(cout)
        self.conv2, self.affine2 = nn.Conv2d(cout, cout, 3, 1, 1), _Affine(cout)
        self.down = down
        main, short = _size(size, 3, s, 1 if s == 1 else 0), (_size(size, 2, 2) if down else size)
        self.out_size = max(main, short)
        # add_prev: zero-pad both operands to the larger shape (pads are static: input is always 150x150).
        self.pad_main = (0, self.out_size - main) * 2
        self.pad_short = (0, self.out_size - short) * 2 + (0, cout - cin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.affine2(self.conv2(F.relu(self.affine1(self.conv1(x)))))
        short = F.avg_pool2d(x, 2, 2) if self.down else x
        if any(self.pad_main):
            y = F.pad(y, self.pad_main)
        if any(self.pad_short):
            short = F.pad(short, self.pad_short)
        return F.relu(y + short)


class DlibResNet(nn.Module):
    """forward(x: [N, 3, 150, 150] float RGB in 0..255) -> [N, 128] descriptors (not normalised), as dlib."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(1, 3, 1, 1))
        self.stem, self.stem_affine = nn.Conv2d(3, 32, 7, 2, 0), _Affine(32)
        size, cin, blocks = _size(_size(INPUT_SIZE, 7, 2), 3, 2), 32, []
        for cout, down in BLOCKS:
            blocks.append(_Block(cin, cout, down, size))
            size, cin = blocks[-1].out_size, cout
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, EMBED_DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.mean) / 256.0
        x = F.max_pool2d(F.relu(self.stem_affine(self.stem(x))), 3, 2)
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


def state_dict_from_dat(weights: DlibWeights) -> dict[str, torch.Tensor]:
    """Map the file's weights onto `DlibResNet`'s parameter names (forward order = file order)."""
    convs = ["stem"] + [f"blocks.{i}.conv{j}" for i in range(len(BLOCKS)) for j in (1, 2)]
    affines = ["stem_affine"] + [f"blocks.{i}.affine{j}" for i in range(len(BLOCKS)) for j in (1, 2)]
    sd = {"mean": torch.tensor(weights.input_mean, dtype=torch.float32).view(1, 3, 1, 1),
          "fc.weight": torch.from_numpy(weights.fc)}
    for name, (w, b, _) in zip(convs, weights.convs, strict=True):
        sd[f"{name}.weight"] = torch.from_numpy(w)
        sd[f"{name}.bias"] = torch.from_numpy(b) if b is not None else torch.zeros(w.shape[0])
    for name, (gamma, beta) in zip(affines, weights.affines, strict=True):
        sd[f"{name}.gamma"], sd[f"{name}.beta"] = torch.from_numpy(gamma), torch.from_numpy(beta)
    return sd


def build_embedder(dat_path: Path) -> DlibResNet:
    """Read dlib's `.dat` and return the equivalent `DlibResNet` in eval mode."""
    model = DlibResNet()
    model.load_state_dict(state_dict_from_dat(read_dat(Path(dat_path))), strict=True)
    return model.eval()
