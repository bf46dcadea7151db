"""Analytic per-layer costs of convolutional image classifiers (ResNet, EfficientNet, resnet-tiny,
convnet-tiny).

Torch-free. Each architecture is written as the sequence of ops its PyTorch module runs
(torchvision's ``resnet50``/``resnet101`` (v1.5: stride on the 3x3 conv) and
``efficientnet_b0``; ``resnet-tiny`` as defined by deepcee.nets), applied to symbolic feature
maps by a :class:`_Tracer` that adds up, per sample and per layer:

- parameters of convolutions, linear layers and norms (BatchNorm and GroupNorm: 2 per
  channel; running statistics are buffers, not parameters);
- multiply-adds (MACs) of convolutions and linear layers; forward FLOPs ``2 x MACs``, weight
  gradient ``2 x MACs``, input gradient ``2 x MACs`` except for a conv reading the image
  (its input needs no gradient). Norms, activations, pooling, residual adds and the
  squeeze-excitation scaling are elementwise and not counted;
- stashed activations, i.e. the tensors autograd keeps: the input of every conv, linear and
  norm, the output of ReLU and Sigmoid, the input of SiLU, both operands of the SE product, the
  input of max pooling plus its int64 indices. A tensor kept by several ops of one layer is
  counted once; the map at a layer boundary can be counted by both layers (e.g. kept as a ReLU
  output by one and as a conv input by the next): exact when the two layers sit on different
  stages, at most one feature map per layer too high otherwise. Dropout and stochastic-depth
  masks are not counted.

Layers: ``stem``, one layer per residual (ResNet, resnet-tiny) or MBConv (EfficientNet) block
named ``block0``.., and ``head`` (EfficientNet: the final 1x1 conv + norm + SiLU, then global
average pooling and the classifier; others: pooling + classifier).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from deepcee.errors import ProfileError
from deepcee.profile import LayerProfile

INDEX_BYTES = 8
"""Bytes per element of the int64 indices max pooling keeps for its backward."""


@dataclass(frozen=True, slots=True)
class _Map:
    """A symbolic feature map of one sample: identity, channels x height x width."""

    key: int
    c: int
    h: int
    w: int
    needs_grad: bool = True

    @property
    def numel(self) -> int:
        return self.c * self.h * self.w


class _Tracer:
    """Applies ops to symbolic maps and accumulates the current layer's costs."""

    def __init__(self, dtype_bytes: int):
        self.dtype_bytes = dtype_bytes
        self._keys = itertools.count()
        self.layers: list[LayerProfile] = []
        self._reset()

    def _reset(self) -> None:
        self.params = 0
        self.weight_macs = 0
        self.input_grad_macs = 0
        self.stash: dict[int, int] = {}

    def new(self, c: int, h: int, w: int, *, needs_grad: bool = True) -> _Map:
        return _Map(next(self._keys), c, h, w, needs_grad)

    def _keep(self, x: _Map, elem_bytes: int | None = None) -> None:
        self.stash[x.key] = x.numel * (elem_bytes or self.dtype_bytes)

    @staticmethod
    def _out_size(size: int, k: int, stride: int) -> int:
        # Padding k // 2 (odd k), as in torchvision: never below 1, so any image size works.
        return (size + 2 * (k // 2) - k) // stride + 1

    # -- ops with weights ----------------------------------------------------------------
    def conv(
        self, x: _Map, cout: int, k: int, stride: int = 1, *, groups: int = 1, bias: bool = False
    ) -> _Map:
        h, w = self._out_size(x.h, k, stride), self._out_size(x.w, k, stride)
        weights = cout * (x.c // groups) * k * k
        macs = weights * h * w
        self.params += weights + (cout if bias else 0)
        self.weight_macs += macs
        self.input_grad_macs += macs if x.needs_grad else 0
        self._keep(x)
        return self.new(cout, h, w)

    def linear(self, x: _Map, cout: int) -> _Map:
        """``Linear(c, cout)`` with bias on a pooled ``c x 1 x 1`` map (a biased 1x1 conv)."""
        return self.conv(x, cout, 1, bias=True)

    def norm(self, x: _Map) -> _Map:
        self.params += 2 * x.c
        self._keep(x)
        return self.new(x.c, x.h, x.w)

    # -- elementwise and pooling ops -----------------------------------------------------
    def relu(self, x: _Map) -> _Map:
        y = self.new(x.c, x.h, x.w)
        self._keep(y)
        return y

    sigmoid = relu  # both backward from their output

    def silu(self, x: _Map) -> _Map:
        self._keep(x)
        return self.new(x.c, x.h, x.w)

    def add(self, a: _Map, b: _Map) -> _Map:
        if (a.c, a.h, a.w) != (b.c, b.h, b.w):
            raise ProfileError(f"residual shapes differ: {a.c}x{a.h}x{a.w} vs {b.c}x{b.h}x{b.w}")
        return self.new(a.c, a.h, a.w)

    def scale(self, x: _Map, gate: _Map) -> _Map:
        """``x * gate`` with a per-channel gate (squeeze-excitation)."""
        self._keep(x)
        self._keep(gate)
        return self.new(x.c, x.h, x.w)

    def max_pool(self, x: _Map, k: int = 3, stride: int = 2) -> _Map:
        y = self.new(x.c, self._out_size(x.h, k, stride), self._out_size(x.w, k, stride))
        self._keep(x)
        self._keep(self.new(y.c, y.h, y.w), INDEX_BYTES)
        return y

    def avg_pool(self, x: _Map) -> _Map:
        """Global average pooling: its backward needs only the shape."""
        return self.new(x.c, 1, 1)

    # -- layer boundary ------------------------------------------------------------------
    def finish(self, name: str, out: _Map) -> _Map:
        """Close the current layer with output ``out``; returns ``out`` for chaining."""
        self.layers.append(
            LayerProfile(
                name=name,
                forward_flops=2.0 * self.weight_macs,
                input_grad_flops=2.0 * self.input_grad_macs,
                weight_grad_flops=2.0 * self.weight_macs,
                parameter_count=self.params,
                activation_bytes=float(sum(self.stash.values())),
                output_bytes=float(out.numel * self.dtype_bytes),
            )
        )
        self._reset()
        return out

    def block_name(self) -> str:
        return f"block{len(self.layers) - 1}"  # layer 0 is the stem


# -- ResNet -------------------------------------------------------------------------------
def _bottleneck(t: _Tracer, x: _Map, width: int, stride: int) -> _Map:
    cout = 4 * width
    y = t.relu(t.norm(t.conv(x, width, 1)))
    y = t.relu(t.norm(t.conv(y, width, 3, stride)))
    y = t.norm(t.conv(y, cout, 1))
    shortcut = t.norm(t.conv(x, cout, 1, stride)) if stride != 1 or x.c != cout else x
    return t.relu(t.add(y, shortcut))


def _basic(t: _Tracer, x: _Map, cout: int, stride: int) -> _Map:
    y = t.relu(t.norm(t.conv(x, cout, 3, stride)))
    y = t.norm(t.conv(y, cout, 3))
    shortcut = t.norm(t.conv(x, cout, 1, stride)) if stride != 1 or x.c != cout else x
    return t.relu(t.add(y, shortcut))


def _resnet(blocks_per_stage: tuple[int, ...]) -> Callable[[_Tracer, _Map, int], None]:
    def build(t: _Tracer, x: _Map, num_classes: int) -> None:
        x = t.finish("stem", t.max_pool(t.relu(t.norm(t.conv(x, 64, 7, 2)))))
        for stage, count in enumerate(blocks_per_stage):
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                x = t.finish(t.block_name(), _bottleneck(t, x, 64 * 2**stage, stride))
        t.finish("head", t.linear(t.avg_pool(x), num_classes))

    return build


def _resnet_tiny(t: _Tracer, x: _Map, num_classes: int) -> None:
    # deepcee.nets resnet-tiny: GroupNorm(4, C) everywhere (2C parameters, like BatchNorm).
    x = t.finish("stem", t.relu(t.norm(t.conv(x, 16, 3))))
    for cout, stride in ((16, 1), (16, 1), (32, 2), (32, 1), (64, 2), (64, 1)):
        x = t.finish(t.block_name(), _basic(t, x, cout, stride))
    t.finish("head", t.linear(t.avg_pool(x), num_classes))


# -- EfficientNet-B0 ----------------------------------------------------------------------
_B0_STAGES = (  # expand ratio, kernel, first stride, output channels, blocks (torchvision)
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)


def _mbconv(t: _Tracer, x: _Map, expand: int, k: int, stride: int, cout: int) -> _Map:
    wide = x.c * expand
    y = t.silu(t.norm(t.conv(x, wide, 1))) if expand != 1 else x
    y = t.silu(t.norm(t.conv(y, wide, k, stride, groups=wide)))
    # Squeeze-excitation on input_channels // 4, with biased 1x1 convs.
    gate = t.conv(t.silu(t.conv(t.avg_pool(y), max(1, x.c // 4), 1, bias=True)), wide, 1, bias=True)
    y = t.norm(t.conv(t.scale(y, t.sigmoid(gate)), cout, 1))
    return t.add(y, x) if stride == 1 and x.c == cout else y


def _efficientnet_b0(t: _Tracer, x: _Map, num_classes: int) -> None:
    x = t.finish("stem", t.silu(t.norm(t.conv(x, 32, 3, 2))))
    for expand, k, stride, cout, count in _B0_STAGES:
        for i in range(count):
            x = t.finish(t.block_name(), _mbconv(t, x, expand, k, stride if i == 0 else 1, cout))
    x = t.silu(t.norm(t.conv(x, 4 * 320, 1)))
    t.finish("head", t.linear(t.avg_pool(x), num_classes))


def _convnet_tiny(t: _Tracer, x: _Map, num_classes: int) -> None:
    # deepcee.nets convnet-tiny: conv + GroupNorm(4, C) + ReLU per block, then pool + linear.
    x = t.finish("stem", t.relu(t.norm(t.conv(x, 16, 3))))
    for cout, stride in ((32, 2), (32, 1), (64, 2)):
        x = t.finish(t.block_name(), t.relu(t.norm(t.conv(x, cout, 3, stride))))
    t.finish("head", t.linear(t.avg_pool(x), num_classes))


ARCHITECTURES: dict[str, Callable[[_Tracer, _Map, int], None]] = {
    "resnet50": _resnet((3, 4, 6, 3)),
    "resnet101": _resnet((3, 4, 23, 3)),
    "efficientnet-b0": _efficientnet_b0,
    "resnet-tiny": _resnet_tiny,
    "convnet-tiny": _convnet_tiny,
}
"""Architecture name -> builder (tracer, image map, number of classes)."""


def cnn_layers(
    arch: str, *, image_size: int, num_classes: int, dtype_bytes: int
) -> tuple[LayerProfile, ...]:
    """Per-sample layer profiles of ``arch`` on ``3 x image_size x image_size`` images."""
    for key, value in (("image_size", image_size), ("num_classes", num_classes)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ProfileError(f"{key} must be a positive integer, got {value!r}")
    if arch not in ARCHITECTURES:
        raise ProfileError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    t = _Tracer(dtype_bytes)
    ARCHITECTURES[arch](t, t.new(3, image_size, image_size, needs_grad=False), num_classes)
    return tuple(t.layers)
