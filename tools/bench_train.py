"""``normgrad bench --train``: one training step of four CNNs and an LSTM, side by side.

A step is forward, cross-entropy against integer labels, backward and one AdamW update
(lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01) of every parameter:

* ``cpp``: normgrad's step graph (``build_step_graph``) in ``normgrad.train.Trainer`` with
  normgrad's C++ kernels and the Trainer's default session options (memory patterns and
  weight pre-packing off);
* ``functions``: the same step graph in plain onnxruntime, on its function bodies;
* ``torch``: torch eager, ``train()`` mode, ``torch.optim.AdamW`` (the same weights);
* ``ort-training``: onnxruntime-training's ``Module`` + ``Optimizer`` (``generate_artifacts``
  with CrossEntropyLoss and AdamW) when ``--ort-training-python`` names a Python that has it.

The models are torch modules exported by torch's TorchScript exporter (training mode,
opset 17): a ResNet basic block with a GAP/Linear head (x [16, 64, 56, 56]), a ResNet-18
(x [16, 3, 112, 112], 1000 classes), a diffusion-UNet block (GroupNorm-SiLU-Conv twice plus
the skip, GAP/Linear head, x [8, 128, 32, 32]) and an EfficientNet MBConv block (1x1 expand,
BN-SiLU, depthwise 3x3, BN-SiLU, squeeze-excite, 1x1 project, BN, skip; x [16, 40, 28, 28]) and an LSTM classifier (2-layer nn.LSTM, hidden 256, batch first,
the last step to a Linear head; x [32, 128, 64]).

The transformer rows are transformers models at random initialization (nothing is
downloaded): a BERT encoder (``BertForMaskedLM``, cross-entropy over every position), a
GPT-2 and a Llama decoder (``GPT2LMHeadModel``, ``LlamaForCausalLM``, causal-LM loss), each
4 layers, hidden 256, vocabulary 8192, input_ids [8, 128], dropout off; each as full
fine-tuning and with peft LoRA (r 8, alpha 16, on the attention and MLP projections; only
the adapters train, on every side). They are exported with the dynamo exporter (logits
only; BERT's flattened to [tokens, vocabulary]); ``torch`` is then transformers' own loss
(``labels=``) and ``torch.optim.AdamW`` over the trainable parameters (+ peft for LoRA);
``ort-training`` gets the decoders' logits shifted and flattened by two appended nodes
(its CrossEntropyLoss wants [N, C]) and the labels shifted to match, and the exporter's
LayerNormalization and SplitToSequence in forms it has gradients for (see the worker). They have no
``functions`` column (the C++ kernels are what the speed target is about, and the column
would add a minute per row).
``--memory`` adds the memory row (alone without ``--models``): a Llama of 265 M parameters
(hidden 1024, 12 layers, 16 heads, vocabulary 32000, untied: 1.06 GB of float32) with peft
LoRA r 8 on its seven projections, input_ids [1, 128], exported with ``external_data=True``
and its step graph written by ``normgrad export --loss causal_lm --optimizer adamw``, which
``cpp`` trains from the files as a user does (``Trainer(step.onnx, step.ckpt)``) while torch
+ peft builds the same model from its seed (no state file loaded beside it); a line under it
gives the two peak RSS and CPU times per step as ratios.
``--genai`` adds the rows of LoRA on onnxruntime-genai's int4 models (alone without
``--models``; ``--models`` also names them one by one): ``llama_int4_lora``, a Llama of 86.9 M
parameters (hidden 768, 6 layers, 12 heads, 4 KV heads, intermediate 2048, vocabulary 32000,
untied), input_ids [4, 128], and ``qwen2_int4_lora``, Qwen2-0.5B's shape (hidden 896, 24
layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936, tied embeddings: 494 M),
input_ids [1, 128]. Each is saved at random weights with a word-level tokenizer and built by
``python -m onnxruntime_genai.models.builder -p int4 -e cpu`` (MatMulNBits, block 32,
GroupQueryAttention); ``normgrad export --loss causal_lm --optimizer adamw --lora-rank 8
--lora-alpha 16 --lora-targets '*_proj*'`` writes its step graph, which ``cpp`` trains from the
files (attention mask all ones). torch + peft trains the float32 model with LoRA r 8 on the
seven projections, its weights replaced by the int4 ones dequantized (as onnxruntime does), so
the agreement check compares like with like (the genai build fuses q, k and v into one
projection, which gets one adapter: the step-2 losses differ by that, about 3e-4 relative).
``--quick`` shrinks every model (CI smoke test). torch (and transformers and peft for the
transformer rows) must be installed to build them.

How it is measured (the header names the CPU: its model, its widest vector extension, AVX2 or
AVX-512, which changes both sides' kernels, and the cores): every variant runs in its own worker process (``tools/_train_worker.py``;
``--threads`` intra-op threads, spinning off, torch ``set_num_threads``), which builds its
session and waits. The parent then runs rounds: in each round every worker does one step, in
turn, and reports its wall time, so machine-load drifts hit all variants alike; the first
two steps are warm-up and agreement check (their losses must agree with ``cpp`` to 1e-3
relative; the step-2 loss depends on the step-1 update, so it checks the gradients and the
optimizer too). The table shows medians and ranges over ``--repeat`` rounds, ratios to torch
and to ort-training, the median CPU time of the worker's process per step
(``time.process_time``: at ``--threads 1`` the work itself, which the machine's load does not
inflate as it does wall time) with its ratio to torch's, and each worker's peak RSS (``VmHWM``) with the part its steps added
above the high-water mark after building (imports, graph building and session creation
excluded). With ``cpp`` and ``ort-training``, profiled steps in an extra session give the
top op types by share of node time (onnxruntime-training writes its profile only when its
session ends, which its Python API does not expose: that profile is mostly unavailable).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import warnings
from typing import Dict, List, Optional, Tuple

import numpy as np

__all__ = ["main", "MODELS", "TRANSFORMERS", "MEMORY_ROW", "GENAI_ROWS", "torch_model"]

MEMORY_ROW = "llama_lora_memory"
GENAI_ROWS = ("llama_int4_lora", "qwen2_int4_lora")
"""``--genai``'s rows: onnxruntime-genai's int4 builds of a Llama and a Qwen2, LoRA r 8."""

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_train_worker.py")

# name: (input shape, quick input shape, classes)
MODELS: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...], int]] = {
    "resnet_block": ((16, 64, 56, 56), (2, 8, 16, 16), 10),
    "resnet18": ((16, 3, 112, 112), (4, 3, 64, 64), 1000),
    "unet_block": ((8, 128, 32, 32), (2, 16, 8, 8), 10),
    "mbconv_block": ((16, 40, 28, 28), (2, 8, 8, 8), 10),
    "mobilenet_v2": ((16, 3, 128, 128), (4, 3, 64, 64), 1000),
    "mobilenet_v3_small": ((16, 3, 128, 128), (4, 3, 64, 64), 1000),
    "shufflenet_v2_x0_5": ((32, 3, 128, 128), (4, 3, 64, 64), 1000),
    "efficientnet_b0": ((16, 3, 128, 128), (4, 3, 64, 64), 1000),
    "convnext": ((16, 3, 128, 128), (4, 3, 64, 64), 1000),
    "lstm": ((32, 128, 64), (4, 16, 8), 10),
}
CNNS = ("mobilenet_v2", "mobilenet_v3_small", "shufflenet_v2_x0_5", "efficientnet_b0", "convnext")
"""torchvision's architectures (``normgrad.tools._torch_cnns``) at full width; ``convnext`` is a
ConvNeXt of dims 48-384 and depths 2, 2, 6, 2 (convnext_tiny's blocks at a quarter of its FLOPs).
``--quick`` shrinks each to a quarter of its width (a single block per stage where it can)."""


# name: (transformers family, LoRA)
TRANSFORMERS: Dict[str, Tuple[str, bool]] = {
    "bert": ("bert", False), "bert_lora": ("bert", True),
    "gpt2": ("gpt2", False), "gpt2_lora": ("gpt2", True),
    "llama": ("llama", False), "llama_lora": ("llama", True),
    MEMORY_ROW: ("llama", True),  # --memory only
    "llama_int4_lora": ("llama", True), "qwen2_int4_lora": ("qwen2", True),  # --genai only
}
OPTION_ROWS = (MEMORY_ROW, *GENAI_ROWS)
"""Rows only their options add (``--memory``, ``--genai``): each trains from the step graph
file ``normgrad export`` writes, as a user does."""
# batch, sequence, vocabulary, hidden, layers, heads
TRANSFORMER_SIZES = {False: (8, 128, 8192, 256, 4, 4), True: (2, 16, 128, 32, 2, 2)}
MEMORY_SIZES = {False: (1, 128, 32000, 1024, 12, 16), True: (1, 16, 512, 64, 2, 2)}
"""The --memory row's Llama: 265 M parameters (1.06 GB of float32), LoRA r 8 on every projection."""
# batch, sequence, vocabulary, hidden, layers, heads, KV heads, intermediate
GENAI_SIZES = {
    # 86.9 M parameters, untied
    "llama_int4_lora": {False: (4, 128, 32000, 768, 6, 12, 4, 2048), True: (2, 16, 512, 64, 2, 4, 2, 128)},
    # Qwen2-0.5B's shape, tied embeddings: 494 M parameters
    "qwen2_int4_lora": {False: (1, 128, 151936, 896, 24, 14, 2, 4864), True: (1, 16, 512, 64, 2, 4, 2, 128)},
}
GENAI_LORA_TARGETS = "*_proj*"
"""The seven projections of the genai build (which fuses q, k and v into one ``qkv_proj``), not the lm_head."""
LORA_TARGETS = {
    "bert": r".*encoder\.layer\.\d+\..*(query|key|value|dense)",  # not the MLM head's transform
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
LORA_TARGETS["qwen2"] = LORA_TARGETS["llama"]
LOSSES = {"bert": "cross_entropy", "gpt2": "causal_lm", "llama": "causal_lm", "qwen2": "causal_lm"}


def _sizes(name: str, quick: bool) -> Tuple[int, ...]:
    if name in GENAI_SIZES:
        return GENAI_SIZES[name][quick]
    return (MEMORY_SIZES if name == MEMORY_ROW else TRANSFORMER_SIZES)[quick]


def transformer_model(name: str, quick: bool, weights: Optional[str] = None):
    """The transformers model of row ``name`` (seeded, random weights, dropout off), wrapped
    by peft LoRA for the ``_lora`` rows; ``weights``: an ``.npz`` of weights (by their names
    in the model) that replace the drawn ones before LoRA is added."""
    import torch
    import transformers

    family, lora = TRANSFORMERS[name]
    torch.manual_seed(0)
    if name in GENAI_SIZES:
        model = _genai_source_model(name, quick)
        if weights:
            with np.load(weights) as arrays, torch.no_grad():
                for key in arrays.files:  # one array read at a time
                    model.get_parameter(key).copy_(torch.from_numpy(arrays[key]))
        return _with_lora(model.train(), family) if lora else model.train()
    _, sequence, vocabulary, hidden, layers, heads = _sizes(name, quick)
    common = dict(vocab_size=vocabulary, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads)
    if family == "bert":
        config = transformers.BertConfig(**common, intermediate_size=4 * hidden, max_position_embeddings=sequence,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.BertForMaskedLM(config)
    elif family == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocabulary, n_embd=hidden, n_layer=layers, n_head=heads,
                                         n_positions=sequence, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         use_cache=False)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(**common, intermediate_size=4 * hidden, num_key_value_heads=heads,
                                          max_position_embeddings=sequence, use_cache=False)
        model = transformers.LlamaForCausalLM(config)
    model.train()
    return _with_lora(model, family) if lora else model


def _with_lora(model, family: str):
    """``model`` wrapped by peft LoRA r 8, alpha 16 on the projections of ``family``."""
    import peft  # only here: its import takes as long as torch's

    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS[family],
                             fan_in_fan_out=family == "gpt2")  # GPT-2's Conv1D stores W transposed
    return peft.get_peft_model(model, config)


def _genai_source_model(name: str, quick: bool):
    """The float32 transformers model (torch seeded by the caller) a ``--genai`` row's int4
    model is built from: a Llama (untied) or a Qwen2 (tied embeddings, biases on q, k, v)."""
    import transformers

    _, _, vocabulary, hidden, layers, heads, kv_heads, intermediate = _sizes(name, quick)
    common = dict(vocab_size=vocabulary, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=2048,
                  use_cache=False)
    if TRANSFORMERS[name][0] == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))


def transformer_batch(name: str, quick: bool) -> Tuple[np.ndarray, np.ndarray]:
    """input_ids and labels of row ``name``: the input tokens for the decoders (the causal-LM
    loss shifts them), other random tokens for BERT, one per position [batch * sequence]."""
    batch, sequence, vocabulary = _sizes(name, quick)[:3]
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, vocabulary, (batch, sequence)).astype(np.int64)
    if LOSSES[TRANSFORMERS[name][0]] == "causal_lm":
        return input_ids, input_ids.copy()
    # flat, as the logits of the exported model are; transformers' loss flattens them too
    return input_ids, rng.integers(0, vocabulary, batch * sequence).astype(np.int64)


def torch_model(name: str, quick: bool):
    """The torch module of benchmark model ``name`` (seeded; ``quick``: 1/8 the widths of resnet18)."""
    if name in TRANSFORMERS:
        return transformer_model(name, quick)
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Head(nn.Module):
        def __init__(self, channels, classes):
            super().__init__()
            self.fc = nn.Linear(channels, classes)

        def forward(self, x):
            return self.fc(x.mean((2, 3)))

    class Basic(nn.Module):
        def __init__(self, cin, cout, stride=1):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
            return torch.relu(y + (x if self.down is None else self.down(x)))

    class UNet(nn.Module):
        def __init__(self, c, groups):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, 1, 1)
            self.n2, self.c2 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, 1, 1)

        def forward(self, x):
            h = self.c1(nn.functional.silu(self.n1(x)))
            return x + self.c2(nn.functional.silu(self.n2(h)))

    class MBConv(nn.Module):
        def __init__(self, c, expand=6, squeeze=4):
            super().__init__()
            e = c * expand
            self.expand = nn.Sequential(nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.SiLU())
            self.depthwise = nn.Sequential(nn.Conv2d(e, e, 3, 1, 1, groups=e, bias=False), nn.BatchNorm2d(e), nn.SiLU())
            self.se = nn.Sequential(nn.Conv2d(e, c // squeeze, 1), nn.SiLU(), nn.Conv2d(c // squeeze, e, 1), nn.Sigmoid())
            self.project = nn.Sequential(nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))

        def forward(self, x):
            h = self.depthwise(self.expand(x))
            return x + self.project(h * self.se(h.mean((2, 3), keepdim=True)))

    class LSTMClassifier(nn.Module):
        def __init__(self, features, hidden, classes):
            super().__init__()
            self.lstm = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
            self.fc = nn.Linear(hidden, classes)

        def forward(self, x):
            return self.fc(self.lstm(x)[0][:, -1])

    shape, quick_shape, classes = MODELS[name]
    if name in CNNS:
        return _seeded_norms(_cnn(name, quick, classes))
    c = (quick_shape if quick else shape)[1]
    if name == "lstm":
        return LSTMClassifier((quick_shape if quick else shape)[2], 16 if quick else 256, classes).train()
    if name == "resnet_block":
        model = nn.Sequential(Basic(c, c), Head(c, classes))
    elif name == "resnet18":
        w = [8, 16, 32, 64] if quick else [64, 128, 256, 512]
        layers = [nn.Conv2d(3, w[0], 7, 2, 3, bias=False), nn.BatchNorm2d(w[0]), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
        cin = w[0]
        for i, cout in enumerate(w):
            layers += [Basic(cin, cout, 1 if i == 0 else 2), Basic(cout, cout)]
            cin = cout
        model = nn.Sequential(*layers, Head(cin, classes))
    elif name == "unet_block":
        model = nn.Sequential(UNet(c, 4 if quick else 32), Head(c, classes))
    else:
        model = nn.Sequential(MBConv(c), Head(c, classes))
    return _seeded_norms(model)


def _cnn(name: str, quick: bool, classes: int):
    """One of :data:`CNNS`, built by ``normgrad.tools._torch_cnns`` (torch seeded by the caller),
    without its classifier's Dropout: torch's masks and onnxruntime's differ, and the bench
    compares their losses."""
    from torch import nn

    model = _cnn_with_dropout(name, quick, classes)
    for module in list(model.modules()):
        for child_name, child in module.named_children():
            if isinstance(child, nn.Dropout):
                setattr(module, child_name, nn.Identity())
    return model


def _cnn_with_dropout(name: str, quick: bool, classes: int):
    from normgrad.tools import _torch_cnns as zoo

    width = 0.25 if quick else 1.0
    if name == "mobilenet_v2":
        return zoo.MobileNetV2(width_mult=width, num_classes=classes)
    if name == "mobilenet_v3_small":
        return zoo.MobileNetV3(width_mult=width, num_classes=classes)
    if name == "shufflenet_v2_x0_5":
        return zoo.ShuffleNetV2(0.5, classes, channels=(8, 16, 32, 64, 64) if quick else None)
    if name == "efficientnet_b0":
        return zoo.EfficientNet(width_mult=width, max_layers=1 if quick else None, num_classes=classes)
    dims, depths = ((8, 16, 32, 64), (1, 1, 1, 1)) if quick else ((48, 96, 192, 384), (2, 2, 6, 2))
    return zoo.ConvNeXt(dims=dims, depths=depths, num_classes=classes)


def _seeded_norms(model):
    """``model`` in training mode, its BatchNorm and GroupNorm affine parameters drawn: their
    default weight 1 and bias 0 would make every scale equal."""
    import torch
    from torch import nn

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    return model.train()


def _export_transformer(name: str, quick: bool, paths: Dict[str, str]) -> None:
    import contextlib
    import io

    import torch

    import normgrad.torch

    model = transformer_model(name, quick)
    input_ids, labels = transformer_batch(name, quick)
    if name != MEMORY_ROW:  # the memory row's torch side builds its model from the seed: no second copy loaded
        torch.save(model.state_dict(), paths["pt"])
    flatten = LOSSES[TRANSFORMERS[name][0]] == "cross_entropy"  # normgrad's cross_entropy wants [N, classes]

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            logits = self.model(input_ids=input_ids).logits
            return logits.reshape(-1, logits.shape[-1]) if flatten else logits

    # the dynamo exporter reports its progress on stdout, which is the bench's table
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normgrad.torch.export(Logits(model), (torch.from_numpy(input_ids),), paths["onnx"], exporter="dynamo",
                              input_names=["input_ids"], output_names=["logits"], external_data=name == MEMORY_ROW)
    if name == MEMORY_ROW:  # the step graph as a user writes it, its frozen base in the forward model's data file
        del model
        from normgrad.tools.export import main as export_main

        with contextlib.redirect_stdout(io.StringIO()):
            code = export_main([paths["onnx"], "-o", paths["step"], "--loss", LOSSES[TRANSFORMERS[name][0]],
                                "--optimizer", "adamw", "--weight-decay", str(0.01)])
        if code:
            raise RuntimeError(f"normgrad export of the --memory row exited {code}")
    np.save(paths["x.npy"], input_ids)
    np.save(paths["labels.npy"], labels)


def _export_genai(name: str, quick: bool, folder: str, paths: Dict[str, str]) -> None:
    """A ``--genai`` row: its transformers model saved (random weights, a word-level
    tokenizer), built int4 by onnxruntime-genai's builder, the step graph written by
    ``normgrad export --lora-*``; the torch side gets the int4 weights dequantized (``.npz``)."""
    import contextlib
    import io

    import torch

    from normgrad.tools.export import main as export_main

    torch.manual_seed(0)
    hf_folder, out = os.path.join(folder, f"{name}.hf"), os.path.join(folder, f"{name}.genai")
    _genai_source_model(name, quick).save_pretrained(hf_folder)
    save_word_tokenizer(hf_folder, _sizes(name, quick)[2])
    built = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf_folder, "-o", out,
                            "-p", "int4", "-e", "cpu", "-c", os.path.join(folder, "genai_cache")],
                           capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"onnxruntime-genai's builder failed on {name}: "
                           f"{(built.stderr.strip().splitlines() or ['no message'])[-1]}")
    int4 = os.path.join(out, "model.onnx")
    np.savez(paths["dequantized"], **_dequantized_weights(name, quick, int4))
    with contextlib.redirect_stdout(io.StringIO()):
        code = export_main([int4, "-o", paths["step"], "--loss", "causal_lm", "--optimizer", "adamw",
                            "--weight-decay", str(0.01), "--lora-rank", "8", "--lora-alpha", "16",
                            "--lora-targets", GENAI_LORA_TARGETS])
    if code:
        raise RuntimeError(f"normgrad export of the genai row {name} exited {code}")
    input_ids, labels = transformer_batch(name, quick)
    np.save(paths["x.npy"], input_ids)
    np.save(paths["labels.npy"], labels)


def save_word_tokenizer(folder: str, vocabulary: int) -> None:
    """Saves to ``folder`` a word-level tokenizer of tokens ``t0`` .. ``t{vocabulary-1}`` (the
    genai builder copies a model's tokenizer; nothing is downloaded)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocabulary)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1",
                                         eos_token="t2").save_pretrained(folder)


def _dequantized_weights(name: str, quick: bool, int4_path: str) -> Dict[str, np.ndarray]:
    """The weights of the genai build's MatMulNBits nodes dequantized as onnxruntime does,
    under their transformers names; the fused ``qkv_proj`` split into q, k and v."""
    import onnx
    from onnx import numpy_helper

    from normgrad.tools._matmul_nbits import dequantize_matmul_nbits

    _, _, _, hidden, _, heads, kv_heads, _ = _sizes(name, quick)
    model = onnx.load(int4_path)
    stored = {t.name: t for t in model.graph.initializer}
    weights = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        arrays = {n: numpy_helper.to_array(stored[n]) for n in node.input[1:] if n}
        weight = dequantize_matmul_nbits(node, arrays).astype(np.float32)
        module = node.input[1].split(".MatMul")[0].replace(".attn.", ".self_attn.")
        if module.endswith("qkv_proj"):
            kv = kv_heads * hidden // heads
            for part, rows in zip("qkv", np.split(weight, [hidden, hidden + kv])):
                weights[module.replace("qkv_proj", f"{part}_proj") + ".weight"] = rows
        else:
            weights[module + ".weight"] = weight  # lm_head: tied to the embedding where the model ties them
    return weights


def _export(name: str, quick: bool, folder: str) -> Dict[str, str]:
    """Writes the model's forward ONNX, torch state, x and labels into ``folder``."""
    paths = {k: os.path.join(folder, f"{name}.{k}") for k in ("onnx", "x.npy", "labels.npy", "pt")}
    if name in OPTION_ROWS:
        paths["step"] = os.path.join(folder, f"{name}.step.onnx")
    if name in GENAI_ROWS:
        paths["dequantized"] = os.path.join(folder, f"{name}.dequantized.npz")
        _export_genai(name, quick, folder, paths)
        return paths
    if name in TRANSFORMERS:
        _export_transformer(name, quick, paths)
        paths["loss"] = LOSSES[TRANSFORMERS[name][0]]
        return paths
    import torch

    shape, quick_shape, classes = MODELS[name]
    shape = quick_shape if quick else shape
    model = torch_model(name, quick)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    labels = rng.integers(0, classes, shape[0]).astype(np.int64)
    torch.save(model.state_dict(), paths["pt"])  # before the export: tracing in training mode moves the BN statistics
    import io

    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the exporter's notes on num_batches_tracked, one per BatchNorm
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(x),), buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, input_names=["x"], output_names=["y"], opset_version=17)
    from normgrad.util.files import write_bytes_atomic

    write_bytes_atomic(paths["onnx"], buffer.getvalue())
    np.save(paths["x.npy"], x)
    np.save(paths["labels.npy"], labels)
    return paths


WORKER_TIMEOUT = 600.0
"""Seconds a worker may take to answer one command (export, warm-up or a step) before it is stopped."""


class _Worker:
    """One variant in its own process: JSON lines over stdin/stdout."""

    def __init__(self, python: str, variant: str, name: str, paths: Dict[str, str], threads: int, quick: bool,
                 wait: bool = True):
        env = dict(os.environ)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        command = [python, WORKER, variant, name, json.dumps(paths), str(threads), "1" if quick else "0"]
        # stderr to a file: onnxruntime's warnings could fill a pipe nobody reads and stall the worker
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        text=True, env=env)
        self.error: Optional[str] = None
        self.ready: dict = {}
        if wait:
            self.wait()

    def wait(self) -> None:
        """Waits for the worker's build (its first reply: the RSS after building)."""
        self.ready = self._reply()

    def _reply(self) -> dict:
        answered, _, _ = select.select([self.process.stdout], [], [], WORKER_TIMEOUT)
        line = self.process.stdout.readline() if answered else ""
        if not line:
            if not answered:
                self.process.kill()
                self.error = f"no answer within {WORKER_TIMEOUT:.0f} s; worker stopped"
                return {}
            self.process.wait()
            self.stderr.seek(0)
            self.error = (self.stderr.read().strip().splitlines() or ["worker exited"])[-1][:160]
            return {}
        reply = json.loads(line)
        if "error" in reply:
            self.error = reply["error"]
        return reply

    def ask(self, command: str) -> dict:
        if self.error:
            return {}
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        try:
            self.process.stdin.write("end\n")
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.stderr.close()


def _top(profile: Dict[str, float], count: int = 5) -> str:
    total = sum(profile.values()) or 1.0
    top = sorted(profile.items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{op} {t / total:.0%}" for op, t in top)


def _title(name: str, quick: bool) -> Tuple[str, str]:
    """The model's heading (name, input shape, loss) and the label of its torch variant."""
    if name not in TRANSFORMERS:
        return f"{name} x {list(MODELS[name][1 if quick else 0])}: training step (forward, cross-entropy", "torch"
    family, lora = TRANSFORMERS[name]
    batch, sequence, vocabulary, hidden, layers = _sizes(name, quick)[:5]
    loss = "causal-LM loss" if LOSSES[family] == "causal_lm" else "cross-entropy"
    what = "LoRA r 8" if lora else "full fine-tuning"
    if name in GENAI_ROWS:
        what += " of the genai builder's int4 model; torch+peft: float32, the int4 weights dequantized"
    return (f"{name} x [{batch}, {sequence}] ({layers} layers, hidden {hidden}, vocabulary {vocabulary}, {what}): "
            f"training step (forward, {loss}"), "torch+peft" if lora else "torch"


def _model_group(name: str, args, folder: str, out) -> bool:
    paths = _export(name, args.quick, folder)
    variants = [("cpp", sys.executable), ("functions", sys.executable), ("torch", sys.executable)]
    if name in TRANSFORMERS:
        variants.remove(("functions", sys.executable))
    if args.ort_training_python and name not in OPTION_ROWS:
        variants.append(("ort-training", args.ort_training_python))
    # the workers build at once (imports, graph building, sessions); the timed steps are one at a time
    workers = {v: _Worker(python, v, name, paths, args.threads, args.quick, wait=False) for v, python in variants}
    for worker in workers.values():
        worker.wait()
    losses: Dict[str, List[float]] = {}
    for _ in range(2):  # warm-up steps; their losses are the agreement check
        for v, worker in workers.items():
            reply = worker.ask("step")
            if "loss" in reply:
                losses.setdefault(v, []).append(reply["loss"])
    times: Dict[str, List[float]] = {v: [] for v in workers}
    cpu_times: Dict[str, List[float]] = {v: [] for v in workers}
    for _ in range(args.repeat):
        for v, worker in workers.items():
            reply = worker.ask("step")
            if "time" in reply:
                times[v].append(reply["time"])
                cpu_times[v].append(reply["cpu"])
    ends = {v: worker.ask("rss") for v, worker in workers.items()}  # before profiling builds another session
    # the --memory row's Trainer reads its step graph file; a profiled session would be a second one
    profiles = {v: worker.ask("profile") for v, worker in workers.items()
                if v in ("cpp", "ort-training") and name not in OPTION_ROWS}
    for worker in workers.values():
        worker.close()

    title, torch_label = _title(name, args.quick)
    print(f"\n{title}, backward, AdamW), {args.threads} threads, median of {args.repeat} interleaved rounds", file=out)
    ok = True
    reference = losses.get("cpp")
    medians = {v: statistics.median(t) for v, t in times.items() if t}
    cpu_medians = {v: statistics.median(t) for v, t in cpu_times.items() if t}
    print(f"  {'variant':<14}{'median':>10}{'range':>22}{'/torch':>8}{'/ort-tr':>9}{'CPU':>10}{'/torch':>8}"
          f"{'peak RSS':>11}{'step RSS':>11}  check (losses of steps 1, 2)", file=out)
    for v, worker in workers.items():
        label = torch_label if v == "torch" else v
        if worker.error or v not in medians:
            # onnxruntime-training lacks some gradients: a row it cannot do is not the bench failing
            state = "n/a" if v == "ort-training" else "failed"
            print(f"  {label:<14}{state}: {worker.error or 'no timing'}", file=out)
            continue
        t = times[v]
        ratio = lambda other: f"{medians[v] / medians[other]:.2f}x" if other in medians else "-"  # noqa: E731
        cpu_ratio = f"{cpu_medians[v] / cpu_medians['torch']:.2f}x" if cpu_medians.get("torch") else "-"
        peak, ready = ends[v].get("peak_mb"), worker.ready.get("rss_mb")
        check = ""
        if reference and v in losses:
            error = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses[v], reference))
            good = error <= 1e-3
            ok &= good
            check = f"{losses[v][0]:.5f} {losses[v][1]:.5f} (vs cpp {error:.1e}{'' if good else ' MISMATCH'})"
        print(f"  {label:<14}{medians[v] * 1e3:8.1f}ms  {min(t) * 1e3:8.1f}-{max(t) * 1e3:8.1f}ms{ratio('torch'):>8}"
              f"{ratio('ort-training'):>9}{cpu_medians[v] * 1e3:8.1f}ms{cpu_ratio:>8}{peak or 0:9.0f}MB{(peak or 0) - (ready or 0):9.0f}MB  {check}", file=out)
    peaks = {v: ends[v].get("peak_mb") for v in ("cpp", "torch") if not workers[v].error}
    if name in OPTION_ROWS and all(peaks.get(v) for v in ("cpp", "torch")) and cpu_medians.get("torch"):
        print(f"  cpp / {torch_label}: peak RSS {peaks['cpp'] / peaks['torch']:.2f}x ({peaks['cpp']:.0f} / "
              f"{peaks['torch']:.0f} MB), CPU time per step {cpu_medians['cpp'] / cpu_medians['torch']:.2f}x", file=out)
    for v, reply in profiles.items():
        if reply.get("profile"):
            print(f"  {v} profile (op types by share of node time): {_top(reply['profile'])}", file=out)
        elif not workers[v].error:
            print(f"  {v} profile: unavailable ({reply.get('profile_error', 'no node events')})", file=out)
    return ok


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="normgrad bench --train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="small models, 3 rounds (CI smoke test)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for every variant (2)")
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (default 7, --quick 3)")
    rows = [*MODELS, *(name for name in TRANSFORMERS if name not in OPTION_ROWS)]
    parser.add_argument("--models", nargs="+", choices=[*rows, *GENAI_ROWS], default=None,
                        help="models to time (default: all but the --genai ones)")
    parser.add_argument("--memory", action="store_true",
                        help=f"the memory row ({MEMORY_ROW}): a 265 M-parameter Llama, LoRA, against torch + peft; "
                             "with no --models, that row alone")
    parser.add_argument("--genai", action="store_true",
                        help=f"the rows {', '.join(GENAI_ROWS)}: LoRA on onnxruntime-genai's int4 builds of an 87 M "
                             "Llama and of Qwen2-0.5B's shape, against torch + peft; with no --models, those rows alone")
    parser.add_argument("--ort-training-python", default=None, metavar="PATH",
                        help="a Python with onnxruntime-training (1.19.2): adds its column")
    args = parser.parse_args(argv)
    args.repeat = args.repeat or (3 if args.quick else 7)
    options = ([MEMORY_ROW] if args.memory else []) + (list(GENAI_ROWS) if args.genai else [])
    args.models = list(dict.fromkeys((args.models or ([] if options else rows)) + options))
    if args.repeat < 1 or args.threads < 1:
        parser.error("--repeat and --threads must be >= 1")
    if args.ort_training_python and not os.access(args.ort_training_python, os.X_OK):
        parser.error(f"--ort-training-python: {args.ort_training_python!r} is not an executable")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("normgrad bench --train: the models are built from torch code; install torch", file=sys.stderr)
        return 2
    if set(args.models) & set(GENAI_ROWS):
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError:
            print("normgrad bench --train --genai: the models are built by onnxruntime-genai's builder; "
                  "install normgrad[genai]", file=sys.stderr)
            return 2
    import onnxruntime

    out = sys.stdout
    print(f"normgrad bench --train: onnxruntime {onnxruntime.__version__}, torch {torch.__version__}, "
          f"{args.threads} threads; one worker process per variant, steps interleaved round by round", file=out)
    from normgrad.tools._bench_options import cpu_description

    print(f"CPU: {cpu_description()}", file=out)
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            ok &= _model_group(name, args, folder, out)
    return 0 if ok else 1
