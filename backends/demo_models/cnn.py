"""A small CNN on scikit-learn's 8x8 digits, trained with torch in seconds and exported to ONNX.

It exists so that quantization (backends/openvino/quantize.py) is tested and benchmarked on
convolutions too, not only on the digits MLP's two matmuls: `input` FP32 [-1, 1, 8, 8] (raw pixel
values 0..16, like the MLP's) -> conv3x3(1->16) relu -> conv3x3(16->32) relu -> maxpool 2 ->
dense(512->10) -> softmax -> `probabilities` FP32 [-1, 10]. The 1/16 input scaling is folded into
the first convolution's weights, so the exported graph starts with the convolution.

The train/test split is `digits_split()`'s, the same as the MLP's, so accuracies compare.
torch is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.demo_models.digits import SEED, digits_split

#: input shape of one row (channels, height, width)
ROW_SHAPE = (1, 8, 8)
CLASSES = 10
CHANNELS = (16, 32)
EPOCHS = 12
BATCH = 32


@dataclass(frozen=True)
class DigitsCNN:
    onnx_path: Path
    #: the training split, rows shaped [N, 1, 8, 8] float32 (raw pixels 0..16): calibration data
    x_train: np.ndarray
    y_train: np.ndarray
    #: the held-out split (25 %), same layout
    x_test: np.ndarray
    y_test: np.ndarray
    #: top-1 accuracy of the torch model on the held-out split
    test_accuracy: float


def as_images(x: np.ndarray) -> np.ndarray:
    """Flat digits rows [N, 64] as the CNN's input [N, 1, 8, 8] (float32)."""
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1, *ROW_SHAPE)


def _network(torch: Any) -> Any:
    nn = torch.nn
    c1, c2 = CHANNELS
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * 4 * 4, CLASSES),
    )


def _train(torch: Any, net: Any, x: np.ndarray, y: np.ndarray) -> None:
    """Adam on the scaled pixels; a few epochs are enough for ~98 % on this data set."""
    xs = torch.from_numpy(x / 16.0)
    ys = torch.from_numpy(y.astype(np.int64))
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(SEED)
    net.train()
    for _ in range(EPOCHS):
        order = torch.randperm(len(xs), generator=gen)
        for start in range(0, len(xs), BATCH):
            idx = order[start : start + BATCH]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(xs[idx]), ys[idx])
            loss.backward()
            optimizer.step()
    net.eval()


def _fold_input_scale(torch: Any, net: Any, scale: float) -> None:
    """Fold `x * scale` into the first convolution, so callers send raw pixels as to the MLP."""
    with torch.no_grad():
        net[0].weight.mul_(scale)


def write_digits_cnn(out_dir: Path, *, name: str = "digits_cnn.onnx") -> DigitsCNN:
    """Train the CNN on the digits training split and write it as ONNX (opset 17, dynamic batch).

    Returns:
        The ONNX path, both splits shaped for the CNN and the held-out top-1 accuracy.
    """
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    x_train, x_test, y_train, y_test = digits_split()
    x_train, x_test = as_images(x_train), as_images(x_test)
    torch.manual_seed(SEED)
    net = _network(torch)
    threads = torch.get_num_threads()
    # One thread: on batches this small, intra-op threads cost more than they give, and each step
    # waits for the slowest one (5x slower on a 2-core machine with one core busy elsewhere).
    torch.set_num_threads(1)
    try:
        _train(torch, net, x_train, y_train)
    finally:
        torch.set_num_threads(threads)
    _fold_input_scale(torch, net, 1.0 / 16.0)
    model = torch.nn.Sequential(net, torch.nn.Softmax(dim=1)).eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
    accuracy = float((predicted == y_test).mean())
    onnx_path = out_dir / name
    torch.onnx.export(
        model,
        (torch.zeros((1, *ROW_SHAPE), dtype=torch.float32),),
        str(onnx_path),
        input_names=["input"],
        output_names=["probabilities"],
        dynamic_axes={"input": {0: "batch"}, "probabilities": {0: "batch"}},
        opset_version=17,
        dynamo=False,  # the TorchScript exporter writes one self-contained file (no .onnx.data)
    )
    return DigitsCNN(onnx_path, x_train, y_train, x_test, y_test, accuracy)
