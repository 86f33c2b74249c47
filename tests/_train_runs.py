"""Trainer runs against torch.optim: step graphs, batches and the torch reference steps the training tests share."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import onnx

from _helpers import old_runtime_python

from normgrad import checkpoint

import _train_runner


STEPS = 20


def _train(runtime, step_path, start, batches, out, accumulation=1):
    """Runs _train_runner in this process or in the old-onnxruntime Python; returns (state, losses, inference model)."""
    os.makedirs(out, exist_ok=True)
    args = [str(step_path), str(start), str(batches), str(out), str(accumulation)]
    if runtime == "current":
        _train_runner.run(*args[:4], accumulation)
    else:
        python = old_runtime_python()
        process = subprocess.run([python, _train_runner.__file__] + args, capture_output=True, text=True, timeout=3600)
        assert process.returncode == 0, process.stderr[-3000:]
    state = checkpoint.load(os.path.join(out, "final.ckpt"))
    return state, np.load(os.path.join(out, "losses.npy")), onnx.load(os.path.join(out, "inference.onnx"))


def _batches(path, shape, classes, steps=STEPS, lrs=None, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps,) + shape).astype(np.float32) * 2 + 0.5
    labels = rng.integers(0, classes, (steps, shape[0]))
    lrs = np.array([lrs(k) for k in range(1, steps + 1)] if callable(lrs) else lrs or [0.05] * steps, np.float32)
    np.savez(path, x=x, labels=labels, lr=lrs)
    return x, labels, lrs


def _step_graph(folder, forward_path, options):
    from normgrad.tools import export as export_tool

    step_path = folder / "step.onnx"
    assert export_tool.main([str(forward_path), "-o", str(step_path), "--loss", "cross_entropy"] + options) == 0
    return step_path, folder / "step.ckpt"


def _torch_steps(torch, net, make_optimizer, clip, x, labels, lrs, accumulation=1):
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = make_optimizer(torch, params)
    losses = []
    for xb, lb, lr in zip(x, labels, lrs):
        for group in optimizer.param_groups:
            group["lr"] = float(lr)
        optimizer.zero_grad()
        total = 0.0
        for xm, lm in zip(np.split(xb, accumulation), np.split(lb, accumulation)):
            loss = torch.nn.functional.cross_entropy(net(torch.tensor(xm)), torch.tensor(lm)) / accumulation
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        losses.append(total)
    return optimizer, np.array(losses)


def _assert_close(actual, expected, what):
    scale = max(np.abs(expected).max(), 1e-30)
    error = np.abs(actual - expected).max()
    assert error <= 1e-5 * scale, f"{what}: max |difference| {error:.3g} vs 1e-5 of its scale {scale:.3g}"
