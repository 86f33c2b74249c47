"""normgrad.checkpoint: bitwise round trip, errors naming the tensor, atomic saves; integrity checks
(truncation, bit flips, a missing checksum), external data read from the checkpoint's folder and
size-checked before it is read, leftovers of killed saves cleaned, the Trainer resuming from them."""

import builtins
import os
import signal
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from normgrad import checkpoint
from normgrad.util.files import write_bytes_atomic
from normgrad.checkpoint import CheckpointError
from normgrad.tools import cli


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


def _small_tensors():
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": np.arange(8, dtype=np.float32)}


def test_truncated_checkpoint_is_refused(tmp_path):
    path = tmp_path / "a.ckpt"
    checkpoint.save(path, _small_tensors(), {"normgrad.step": "120"})
    data = path.read_bytes()
    model = onnx.load_model_from_string(data)
    cut = len(data) - sum(entry.ByteSize() + 2 for entry in model.metadata_props)  # just before the metadata
    for length in (cut, len(data) - 1, len(data) // 2, 0):
        path.write_bytes(data[:length])
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.load(path)


def test_bit_flips_are_refused(tmp_path):
    path = tmp_path / "a.ckpt"
    checkpoint.save(path, _small_tensors(), {"normgrad.step": "120"})
    data = path.read_bytes()
    rng = np.random.default_rng(1)
    for position in rng.choice(len(data) * 8, 200, replace=False):
        flipped = bytearray(data)
        flipped[position // 8] ^= 1 << (position % 8)
        path.write_bytes(bytes(flipped))
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.load(path)


def test_missing_checksum_is_refused_unless_asked(tmp_path):
    model = helper.make_model(helper.make_graph([], "normgrad_checkpoint", [], [],
                                                initializer=[numpy_helper.from_array(np.ones(3, np.float32), "w")]))
    path = tmp_path / "old.ckpt"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(checkpoint.CheckpointError, match="normgrad.checksum"):
        checkpoint.load(path)
    assert checkpoint.load(path, verify=False).tensors["w"].tolist() == [1, 1, 1]


def test_empty_checkpoint_file_says_so(tmp_path):
    (tmp_path / "e.ckpt").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match="empty"):
        checkpoint.load(tmp_path / "e.ckpt")


# ------------------------------------------------------------------ external data


def test_external_data_is_read_from_the_checkpoint_folder(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    folder.mkdir()
    tensors = _small_tensors()
    checkpoint.save(folder / "a.ckpt", tensors, external_data=True)
    decoy = tmp_path / "elsewhere"
    decoy.mkdir()
    for name in os.listdir(folder):  # the same file names with other bytes in the working directory
        (decoy / name).write_bytes(bytes(len((folder / name).read_bytes())))
    monkeypatch.chdir(decoy)
    loaded = checkpoint.load(folder / "a.ckpt")
    for name, value in tensors.items():
        assert loaded.tensors[name].tobytes() == value.tobytes()


def _external_checkpoint(path, location, shape, offset=0):
    tensor = onnx.TensorProto(name="w1", data_type=onnx.TensorProto.FLOAT, dims=shape)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    length = int(np.prod(shape)) * 4
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)
    model = helper.make_model(helper.make_graph([], "normgrad_checkpoint", [], [], initializer=[tensor]))
    helper.set_model_props(model, {checkpoint.CHECKSUM_METADATA: "sha256:0"})
    path.write_bytes(model.SerializeToString())


def test_external_data_outside_the_folder_is_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(np.ones(4, np.float32).tobytes())
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    for location in ("../secret.bin", str(tmp_path / "secret.bin"), "link.bin"):
        _external_checkpoint(folder / "a.ckpt", location, [4])
        with pytest.raises(checkpoint.CheckpointError, match="outside|plain relative"):
            checkpoint.load(folder / "a.ckpt")


def test_huge_external_data_fails_before_reading(tmp_path, monkeypatch):
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    elements = 2 * memory // 4
    with open(tmp_path / "w1.bin", "wb") as file:  # sparse: takes no disk
        file.truncate(elements * 4)
    _external_checkpoint(tmp_path / "a.ckpt", "w1.bin", [elements])
    opened = []
    monkeypatch.setattr(checkpoint, "open", lambda path, *args, **kwargs: opened.append(os.fspath(path)) or
                        builtins.open(path, *args, **kwargs), raising=False)
    with pytest.raises(checkpoint.CheckpointError, match="memory"):
        checkpoint.load(tmp_path / "a.ckpt")
    assert opened and not [path for path in opened if path.endswith("w1.bin")], f"read before the refusal: {opened}"


def test_short_external_data_is_refused_before_reading(tmp_path):
    (tmp_path / "w1.bin").write_bytes(bytes(12))
    _external_checkpoint(tmp_path / "a.ckpt", "w1.bin", [4])
    with pytest.raises(checkpoint.CheckpointError, match="cut short"):
        checkpoint.load(tmp_path / "a.ckpt")


def test_large_checkpoints_use_external_data_and_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "EXTERNAL_DATA_BYTES", 100)  # the > 2 GiB path, at small size
    tensors = {**_small_tensors(), "small": np.zeros(2, np.int64), "scalar": np.array(3.5, np.float64)}
    path = tmp_path / "big.ckpt"
    checkpoint.save(path, tensors, {"normgrad.step": "7"})
    data_files = [name for name in os.listdir(tmp_path) if name.endswith(".data")]
    assert len(data_files) == 1 and os.path.getsize(path) < 1000
    loaded = checkpoint.load(path)
    assert loaded.metadata == {"normgrad.step": "7"}
    for name, value in tensors.items():
        assert loaded.tensors[name].dtype == value.dtype and loaded.tensors[name].tobytes() == value.tobytes()
    # onnx reads it too
    model = onnx.load(str(path))
    assert numpy_helper.to_array(model.graph.initializer[0]).tobytes() == tensors["w"].tobytes()
    # a second save replaces the data file, and the old one goes
    tensors["w"] = tensors["w"] + 1
    checkpoint.save(path, tensors)
    assert [name for name in os.listdir(tmp_path) if name.endswith(".data")] != data_files
    assert len(os.listdir(tmp_path)) == 2
    assert checkpoint.load(path).tensors["w"].tobytes() == tensors["w"].tobytes()
    # a flipped bit in the data file is caught
    data_file = next(tmp_path.glob("*.data"))
    flipped = bytearray(data_file.read_bytes())
    flipped[5] ^= 4
    data_file.write_bytes(bytes(flipped))
    with pytest.raises(checkpoint.CheckpointError, match="altered"):
        checkpoint.load(path)


def test_protobuf_would_refuse_what_external_data_writes(monkeypatch):
    """The limit the external-data threshold stays under: protobuf refuses 2 GiB messages."""
    assert checkpoint.EXTERNAL_DATA_BYTES < 2**31


# ------------------------------------------------------------------ SIGKILL during save


KILLED_SAVE = """
import os, signal, sys
import numpy as np
from normgrad import checkpoint
external = sys.argv[2] == "external"
if external:
    checkpoint.EXTERNAL_DATA_BYTES = 10
real_replace = os.replace
calls = []
def replace_then_die(source, target):
    calls.append(target)
    if len(calls) == (2 if external else 1):
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(source, target)
os.replace = replace_then_die
checkpoint.save(sys.argv[1], {"w": np.ones(1000, np.float32)})
"""


@pytest.mark.parametrize("layout", ["inline", "external"])
def test_leftovers_of_a_killed_save_go_at_the_next_save(tmp_path, layout):
    path = tmp_path / "a.ckpt"
    checkpoint.save(path, {"w": np.zeros(1000, np.float32)})
    for _ in range(2):
        process = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(path), layout], capture_output=True, timeout=900)
        assert process.returncode == -signal.SIGKILL
    assert len(os.listdir(tmp_path)) > 1  # the killed saves left files behind
    assert checkpoint.load(path).tensors["w"].tobytes() == np.zeros(1000, np.float32).tobytes()  # old one intact
    checkpoint.save(path, {"w": np.full(1000, 2.0, np.float32)})
    assert os.listdir(tmp_path) == ["a.ckpt"]


def test_a_live_writer_temporary_is_kept(tmp_path):
    live = tmp_path / f".a.bin.{os.getppid()}.abc123.tmp"  # our parent runs: its file may still be renamed
    live.write_bytes(b"in progress")
    write_bytes_atomic(tmp_path / "a.bin", b"x")
    assert live.exists()


# ------------------------------------------------------------------ the Trainer on these checkpoints


def test_trainer_resumes_from_external_data_in_another_working_directory(forward_path, tmp_path, monkeypatch):
    from normgrad.train import Trainer, TrainerError

    step = tmp_path / "step.onnx"
    assert cli.main(["export", str(forward_path), "-o", str(step), "--loss", "mse", "--optimizer", "adam"]) == 0
    trainer = Trainer(step, tmp_path / "step.ckpt", lr=0.01)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    trainer.step(x, y)
    monkeypatch.setattr(checkpoint, "EXTERNAL_DATA_BYTES", 16)
    (tmp_path / "run").mkdir()
    trainer.save(tmp_path / "run" / "s.ckpt")
    assert any(name.endswith(".data") for name in os.listdir(tmp_path / "run"))
    monkeypatch.chdir(tmp_path)
    resumed = Trainer(step, "run/s.ckpt", lr=0.01)
    monkeypatch.chdir(tmp_path / "run")
    assert resumed.step_count == 1
    for name, value in trainer.state_dict().items():
        assert resumed.state_dict()[name].tobytes() == value.tobytes()
    data = (tmp_path / "run" / "s.ckpt").read_bytes()
    (tmp_path / "run" / "cut.ckpt").write_bytes(data[: len(data) - 30])
    with pytest.raises(TrainerError, match="cut short|checksum|not a checkpoint"):
        Trainer(step, tmp_path / "run" / "cut.ckpt")
