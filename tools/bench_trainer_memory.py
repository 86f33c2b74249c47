"""Bytes of the Trainer's state buffers and the process's peak RSS, ResNet-18 and a
transformer, AdamW (the figures of docs/explanation/training-trust.md):

    python -m normgrad.tools.bench_trainer_memory MODEL VARIANT

MODEL: resnet18 | bert (needs torch and transformers); VARIANT: gated (the Trainer as is),
two_buffers (nothing updated in place), ungated_rule (buffers only: the in-place rule applied
to the step graph as written, as before issue 19.1). Prints one JSON line.
"""
import json, os, resource, sys, tempfile, time
import numpy as np, onnx

model_name, variant = sys.argv[1], sys.argv[2]
folder = tempfile.mkdtemp(prefix="normgrad-bench-")
from normgrad.graphs import build_step_graph, build_training_graph, examples, structure
import normgrad.train as train

if model_name == "resnet18":
    forward = examples.resnet18(batch=8, size=64)
    make = lambda rng: {"x": rng.standard_normal((8, 3, 64, 64)).astype(np.float32),
                        "labels": rng.integers(0, 10, 8)}
    loss = "cross_entropy"
else:
    import torch, transformers
    import normgrad.torch as nt
    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                                     vocab_size=1000, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    class First(torch.nn.Module):
        def __init__(self):
            super().__init__(); self.m = transformers.BertModel(config, add_pooling_layer=False)
        def forward(self, ids):
            return self.m(input_ids=ids)[0]
    torch.manual_seed(0)
    forward = nt.export(First().train(), (torch.ones(8, 32, dtype=torch.long),), os.path.join(folder, "bert.onnx"),
                        input_names=["x"], output_names=["y"])
    make = lambda rng: {"x": rng.integers(1, 1000, (8, 32)), "labels": rng.standard_normal((8, 32, 256)).astype(np.float32)}
    loss = "mse"
step, initial = build_step_graph(build_training_graph(forward, loss=loss), "adamw", weight_decay=0.1)
state_bytes = sum(v.nbytes for v in initial.values())
if variant == "two_buffers":
    structure.in_place_updates = lambda graph, state: set()
if variant == "ungated_rule":  # what main's rule saves, decided on the step graph as written (unsound)
    state_map = json.loads({e.key: e.value for e in step.metadata_props}["normgrad.state"])
    shared = structure.in_place_updates(step.graph, state_map)
    print(json.dumps({"model": model_name, "variant": variant, "state_MB": round(state_bytes / 2**20, 1),
                      "buffers_MB": round(sum(initial[n].nbytes * (1 if n in shared else 2) for n in initial) / 2**20, 1)}))
    sys.exit()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
trainer = train.Trainer(step, initial, lr=1e-3)
buffers = sum(initial[n].nbytes * (1 if n in trainer._in_place else 2) for n in initial)
rng = np.random.default_rng(0)
trainer.step(**make(rng))
start = time.perf_counter()
for _ in range(5):
    trainer.step(**make(rng))
per_step = (time.perf_counter() - start) / 5
print(json.dumps({"model": model_name, "variant": variant, "state_MB": round(state_bytes / 2**20, 1),
                  "buffers_MB": round(buffers / 2**20, 1), "peak_rss_MB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "rss_before_trainer_MB": round(base / 1024, 1), "s_per_step": round(per_step, 3)}))
