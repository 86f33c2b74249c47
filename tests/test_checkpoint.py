"""normgrad.checkpoint: bitwise round trip, errors naming the tensor, atomic saves."""

import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from normgrad import checkpoint
from normgrad.checkpoint import CheckpointError


def _tensors():
    rng = np.random.default_rng(0)
    tensors = {
        "conv1.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "half": rng.standard_normal((5,)).astype(np.float16),
        "count": np.array([3, -7, 2**40], dtype=np.int64),
        "scalar": np.array(0.1, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    # awkward float32 bit patterns: NaN payload, -0.0, subnormal, inf
    tensors["bits"] = np.array([0x7FC00123, 0x80000000, 0x00000001, 0x7F800000], dtype=np.uint32).view(np.float32)
    bfloat16 = numpy_helper.to_array(
        onnx.helper.make_tensor("b", onnx.TensorProto.BFLOAT16, [3], [1.5, -2.25, 3e38])
    )
    tensors["bf16"] = bfloat16
    return tensors


def test_round_trip_is_bitwise(tmp_path):
    path = tmp_path / "state.ckpt"
    tensors = _tensors()
    checkpoint.save(path, tensors, {"normgrad.step": "10", "note": "é"})
    loaded = checkpoint.load(path)
    assert loaded.metadata == {"normgrad.step": "10", "note": "é"}
    assert list(loaded.tensors) == list(tensors)
    for name, value in tensors.items():
        got = loaded.tensors[name]
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert got.tobytes() == value.tobytes(), name
    model = onnx.load(str(path))  # an ordinary ONNX file
    assert model.ir_version == 10
    assert {t.data_type for t in model.graph.initializer} >= {
        onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT64
    }


def test_check_matches_names_the_tensor(tmp_path):
    path = tmp_path / "state.ckpt"
    checkpoint.save(path, {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)})
    loaded = checkpoint.load(path)
    good = {"w": (np.float32, (2, 3)), "b": (np.float32, (3,))}
    checkpoint.check_matches(loaded, good)
    with pytest.raises(CheckpointError, match="no tensor 'v'"):
        checkpoint.check_matches(loaded, {**good, "v": (np.float32, (1,))})
    with pytest.raises(CheckpointError, match="tensor 'b', which is not expected"):
        checkpoint.check_matches(loaded, {"w": good["w"]})
    with pytest.raises(CheckpointError, match=r"'w' has shape \[2, 3\], expected \[3, 2\]"):
        checkpoint.check_matches(loaded, {**good, "w": (np.float32, (3, 2))})
    with pytest.raises(CheckpointError, match="'b' has dtype float32, expected float16"):
        checkpoint.check_matches(loaded, {**good, "b": (np.float16, (3,))})


def test_unreadable_files(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(tmp_path / "absent.ckpt")
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"\xff\x00 not protobuf \x01\x02")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        checkpoint.load(garbage)
    model_path = tmp_path / "model.onnx"
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    onnx.save(onnx.helper.make_model(graph), str(model_path))
    with pytest.raises(CheckpointError, match="only initializers"):
        checkpoint.load(model_path)


def test_bad_tensors_refused(tmp_path):
    with pytest.raises(CheckpointError, match="'w' must be a numpy.ndarray"):
        checkpoint.save(tmp_path / "a.ckpt", {"w": [1.0, 2.0]})
    with pytest.raises(CheckpointError, match="'o'"):
        checkpoint.save(tmp_path / "a.ckpt", {"o": np.array([object()])})
    assert not os.listdir(tmp_path)


def test_crash_while_saving_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.ckpt"
    checkpoint.save(path, {"w": np.ones(4, np.float32)})
    before = path.read_bytes()

    def crash(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        checkpoint.save(path, {"w": np.full(1000, 2.0, np.float32)})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["state.ckpt"]
    assert checkpoint.load(path).tensors["w"].tobytes() == np.ones(4, np.float32).tobytes()
