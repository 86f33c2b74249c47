"""A frozen base is read in place: onnxruntime, at every graph optimization level, runs the
step graph of a model whose frozen base is in external data without a second copy of any
base weight (no Transpose of one computed per step, no transposed or otherwise folded
initializer derived from one). Checked on the graph onnxruntime writes of what it runs
(``SessionOptions.optimized_model_filepath``) for a tiny peft LoRA Llama exported with
dynamo, whose projections are ``MatMul(x, Transpose(W))``."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import normgrad

import _external_data_models as external

LEVELS = {
    "disable_all": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@pytest.fixture(scope="module")
def step_path(tmp_path_factory):
    torch, lora_models = external._torch()
    import normgrad.torch

    input_ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model, _ = lora_models._peft_model("llama")
    folder = tmp_path_factory.mktemp("model")
    normgrad.torch.export(normgrad.torch.causal_lm_logits(model), (input_ids,), folder / "forward.onnx",
                          exporter="dynamo", input_names=["input_ids"], output_names=["logits"], external_data=True)
    external._write_step_graph(folder / "forward.onnx", folder / "step.onnx")
    return folder / "step.onnx"


@pytest.mark.slow
@pytest.mark.parametrize("level", list(LEVELS))
def test_no_second_copy_of_the_frozen_base(step_path, tmp_path, level):
    external = {t.name for t in onnx.load(step_path, load_external_data=False).graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}
    base = {t.name: _sorted_values(t) for t in onnx.load(step_path).graph.initializer if t.name in external}
    assert len(base) > 5
    options = normgrad.session_options("cpp", ort.SessionOptions())
    options.graph_optimization_level = LEVELS[level]
    options.optimized_model_filepath = str(tmp_path / "running.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "running.onnx.data")
    ort.InferenceSession(str(step_path), options, providers=["CPUExecutionProvider"])
    running = onnx.load(tmp_path / "running.onnx").graph
    transposed = [n.name or n.output[0] for n in running.node if n.op_type == "Transpose" and set(n.input) & set(base)]
    assert not transposed, f"Transposes of frozen base weights run every step: {transposed[:5]}"
    # a folded copy (transposed, reshaped, cast) holds the same values in another order
    copies = [(t.name, name) for t in running.initializer if t.name not in base and t.data_type in FLOATS
              for name, values in base.items() if np.array_equal(_sorted_values(t), values)]
    assert not copies, f"initializers holding a base weight's values beside it: {copies[:5]}"
    read = {name for n in running.node for name in n.input}
    assert set(base) <= read | {i.name for i in running.input}, "base weights replaced by copies under other names"


FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


def _sorted_values(tensor: onnx.TensorProto) -> np.ndarray:
    return np.sort(onnx.numpy_helper.to_array(tensor).astype(np.float64).ravel())
