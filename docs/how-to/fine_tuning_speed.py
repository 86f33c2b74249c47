"""One step of a Llama-style decoder (4 layers, hidden 256, vocabulary 8192, sequence 128,
batch 8, AdamW, causal-LM loss): normgrad's Trainer against torch eager (+ peft for LoRA),
interleaved in one process, 3 rounds of 3 steps each, median per step; THREADS threads
(default 2). A one-off measurement for docs/how-to/fine-tuning.md, not `normgrad bench`.

usage: THREADS=2 python docs/how-to/fine_tuning_speed.py lora|full default|disabled [profile]
(``disabled``: onnxruntime graph optimizations off; ``profile``: write an onnxruntime
profile of the normgrad session and print its path)"""

import json
import os
import sys
import time

import numpy as np
import onnxruntime as ort
import peft
import torch
import transformers

import normgrad.torch
from normgrad.graphs import build_step_graph, build_training_graph
from normgrad.train import Trainer

mode, level = sys.argv[1], sys.argv[2]
threads = int(os.environ.get("THREADS", "2"))
torch.set_num_threads(threads)
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
model = transformers.LlamaForCausalLM(config)
if mode == "lora":
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
input_ids = torch.randint(0, 8192, (8, 128))
labels = input_ids.clone()




forward = normgrad.torch.export(normgrad.torch.causal_lm_logits(model), (input_ids,), f"fine_tuning_speed_{mode}.onnx", exporter="dynamo",
                                input_names=["input_ids"], output_names=["logits"])
step_graph, initial = build_step_graph(build_training_graph(forward, loss="causal_lm"), "adamw")
options = ort.SessionOptions()
options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
if level == "disabled":
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
profile = len(sys.argv) > 3
if profile:
    options.enable_profiling = True
    options.profile_file_prefix = f"fine_tuning_speed_{mode}_{level}"
trainer = Trainer(step_graph, initial, lr=1e-4, session_options=options)
feeds = {"input_ids": input_ids.numpy(), "labels": labels.numpy()}
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def torch_step():
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=input_ids, labels=labels, use_cache=False).loss.backward()
    optimizer.step()


sides = {"normgrad": lambda: trainer.step(**feeds), "torch": torch_step}
for run in sides.values():
    run()
times = {side: [] for side in sides}
for _ in range(3):
    for side, run in sides.items():
        start = time.perf_counter()
        for _ in range(3):
            run()
        times[side].append((time.perf_counter() - start) / 3)
median = {side: 1000 * float(np.median(values)) for side, values in times.items()}
print(json.dumps({"mode": mode, "level": level, "threads": threads, "median_ms": median,
                  "ratio": median["normgrad"] / median["torch"],
                  "all_ms": {side: [round(1000 * t) for t in values] for side, values in times.items()}}))
if profile:
    print("profile", trainer._step_part.session.end_profiling())
