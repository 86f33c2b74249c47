"""SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss gradients against torch autograd
(F.cross_entropy / F.nll_loss with the same options, float64) and float64 finite differences."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnxruntime as ort
import pytest

from normgrad.graphs import build_training_graph
from normgrad.graphs.examples import model

DOUBLE = onnx.TensorProto.DOUBLE
CLASSES = 4


def _loss_model(op_type, shape, reduction, ignore_index, weighted, log_prob):
    """y = op(x, labels[, class weights as a Constant]) (+ the log-probabilities output)."""
    inputs = ["x", "labels"] + (["w"] if weighted else [])
    outputs = ["y"] + (["log_prob"] if log_prob else [])
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    nodes = [oh.make_node(op_type, inputs, outputs, **attrs)]
    if weighted:
        w = np.random.default_rng(7).uniform(0.5, 2.0, CLASSES)
        nodes.insert(0, oh.make_node("Constant", [], ["w"], value=onh.from_array(w)))
    forward = model(nodes, {"x": shape}, outputs, opset=17, elem_type=DOUBLE)
    forward.graph.input.append(oh.make_tensor_value_info("labels", onnx.TensorProto.INT64, [shape[0], *shape[2:]]))
    return forward, (w if weighted else None)


def _batch(shape, ignore_index, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2
    labels = rng.integers(0, CLASSES, (shape[0], *shape[2:])).astype(np.int64)
    if ignore_index is not None:
        labels.reshape(-1)[::3] = ignore_index
    return x, labels


def _gradient(training, x, labels, dy, dlog_prob=None):
    session = ort.InferenceSession(training.model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": x, "labels": labels, "y_grad": dy}
    if dlog_prob is not None:
        feeds["log_prob_grad"] = dlog_prob
    return session.run(["x_grad"], training.feeds(feeds))[0]


CASES = [
    # op, x shape, reduction, ignore_index, weighted, log-prob output
    ("SoftmaxCrossEntropyLoss", (6, CLASSES), "mean", None, False, False),
    ("SoftmaxCrossEntropyLoss", (6, CLASSES), "sum", None, True, False),
    ("SoftmaxCrossEntropyLoss", (6, CLASSES), "none", 2, False, False),
    ("SoftmaxCrossEntropyLoss", (3, CLASSES, 2, 3), "mean", -100, True, False),
    ("SoftmaxCrossEntropyLoss", (3, CLASSES, 5), "none", None, True, True),
    ("SoftmaxCrossEntropyLoss", (3, CLASSES, 5), "mean", -1, False, True),
    ("NegativeLogLikelihoodLoss", (6, CLASSES), "mean", None, True, False),
    ("NegativeLogLikelihoodLoss", (6, CLASSES), "sum", 1, False, False),
    ("NegativeLogLikelihoodLoss", (3, CLASSES, 2, 3), "none", -100, True, False),
    ("NegativeLogLikelihoodLoss", (3, CLASSES, 5), "mean", 0, True, False),
]


@pytest.mark.parametrize("op_type, shape, reduction, ignore_index, weighted, log_prob", CASES)
def test_loss_gradient_matches_torch(op_type, shape, reduction, ignore_index, weighted, log_prob):
    torch = pytest.importorskip("torch")
    forward, w = _loss_model(op_type, shape, reduction, ignore_index, weighted, log_prob)
    training = build_training_graph(forward)
    x, labels = _batch(shape, ignore_index)
    rng = np.random.default_rng(1)
    dy = rng.standard_normal((shape[0], *shape[2:]) if reduction == "none" else ())
    dlog_prob = rng.standard_normal(shape) if log_prob else None
    got = _gradient(training, x, labels, dy, dlog_prob)

    x_torch = torch.tensor(x, requires_grad=True)
    options = {"weight": None if w is None else torch.tensor(w), "reduction": reduction,
               "ignore_index": -100 if ignore_index is None else ignore_index}
    functional = torch.nn.functional.cross_entropy if op_type == "SoftmaxCrossEntropyLoss" else torch.nn.functional.nll_loss
    loss = functional(x_torch, torch.tensor(labels), **options)
    total = (loss * torch.tensor(dy)).sum()
    if log_prob:
        total = total + (torch.log_softmax(x_torch, 1) * torch.tensor(dlog_prob)).sum()
    total.backward()
    np.testing.assert_allclose(got, x_torch.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op_type, shape, reduction, ignore_index, weighted, log_prob", CASES[::2])
def test_loss_gradient_matches_finite_differences(op_type, shape, reduction, ignore_index, weighted, log_prob):
    """<dy, y(x + h v)> - <dy, y(x - h v)> over 2h against <x_grad, v>, through onnxruntime's own forward op."""
    forward, _ = _loss_model(op_type, shape, reduction, ignore_index, weighted, log_prob)
    training = build_training_graph(forward)
    x, labels = _batch(shape, ignore_index, seed=2)
    rng = np.random.default_rng(3)
    dy = rng.standard_normal((shape[0], *shape[2:]) if reduction == "none" else ())
    dlog_prob = rng.standard_normal(shape) if log_prob else None
    got = _gradient(training, x, labels, dy, dlog_prob)
    session = ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"])

    def objective(values):
        outputs = session.run(None, {"x": values, "labels": labels})
        return float(np.sum(outputs[0] * dy) + (np.sum(outputs[1] * dlog_prob) if log_prob else 0.0))

    for _ in range(3):
        v = rng.standard_normal(shape)
        h = 1e-6
        numeric = (objective(x + h * v) - objective(x - h * v)) / (2 * h)
        assert abs(numeric - float(np.sum(got * v))) <= 1e-6 * max(1.0, abs(numeric))


def _own_loss_model(kind):
    """A tiny random transformers model (no download) and a batch: BART's language-model
    loss (labels padded with -100) or BERT's sequence-classification loss."""
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "bart":
        config = transformers.BartConfig(
            vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        return transformers.BartForConditionalGeneration(config), torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16)
    return transformers.BertForSequenceClassification(config), torch.tensor([0, 2])


@pytest.mark.slow
@pytest.mark.parametrize("kind, exporter", [("bart", "torchscript"), ("bert", "dynamo")])
def test_model_computing_its_own_loss_trains_as_torch(kind, exporter, tmp_path):
    """The loss a transformers model computes when called with labels, through --loss-output:
    three SGD steps give torch's losses (each after the previous steps' updates)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import normgrad.torch
    from normgrad.graphs import build_step_graph
    from normgrad.train import Trainer

    network, labels = _own_loss_model(kind)
    network.train()

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = network

        def forward(self, input_ids, labels):
            return self.model(input_ids=input_ids, labels=labels).loss

    input_ids = torch.randint(3, 40, (2, 6))
    normgrad.torch.export(WithLoss(), (input_ids, labels), tmp_path / "own.onnx", exporter=exporter,
                          input_names=["input_ids", "labels"], output_names=["loss"])
    forward = onnx.load(str(tmp_path / "own.onnx"))
    assert {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"} & {n.op_type for n in forward.graph.node}
    trainer = Trainer(*build_step_graph(build_training_graph(forward, loss_output="loss"), "sgd"), lr=0.1)
    reference = torch.optim.SGD(network.parameters(), lr=0.1)
    for _ in range(3):
        ours = trainer.step(input_ids.numpy(), labels.numpy())
        reference.zero_grad()
        theirs = WithLoss()(input_ids, labels)
        theirs.backward()
        reference.step()
        assert ours == pytest.approx(theirs.item(), rel=1e-5)
