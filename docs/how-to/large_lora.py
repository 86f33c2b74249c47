"""LoRA past protobuf's 2 GiB limit: a random Qwen2 of about 0.6 B parameters (2.3 GB of
float32 weights), peft LoRA on every projection, exported with its frozen base in external
data, its step graph written by ``normgrad export``, a few AdamW steps in normgrad's Trainer
and the same steps in torch + peft; each phase in its own process, with its peak RSS.

    python docs/how-to/large_lora.py all --folder /tmp/large    # the figures of docs/how-to/fine-tuning.md, "Past 2 GiB"
    python docs/how-to/large_lora.py all --folder /tmp/small --hidden 64 --intermediate 128 --layers 2 --vocab 512

Phases (``all`` runs them one after another, each a new process, and prints a summary):
``export`` (torch + peft model, dynamo export with ``external_data=True``), ``build``
(``normgrad export FOLDER/forward.onnx -o FOLDER/step.onnx --loss causal_lm --optimizer
adamw``, in-process through ``normgrad.tools.export.main``), ``train`` (Trainer on the step
graph by path: session creation, then the steps, then the adapter and the merged model),
``torch`` (the same model, batch and AdamW steps in torch + peft). Peak RSS per phase is the
kernel's VmHWM, reset between the parts of a phase (``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from normgrad.util.files import write_bytes_atomic


def _save_array(path: str, array) -> None:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    write_bytes_atomic(path, buffer.getvalue())


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class Meter:
    """Peak and current RSS of the parts of one phase."""

    def __init__(self) -> None:
        self.parts = []
        self._reset()

    def _reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as file:
                file.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self._start = time.perf_counter()

    def mark(self, what: str) -> None:
        self.parts.append({"part": what, "peak_rss_gib": _status("VmHWM") / 2**30,
                           "rss_after_gib": _status("VmRSS") / 2**30, "seconds": time.perf_counter() - self._start})
        print(f"  {what}: peak RSS {self.parts[-1]['peak_rss_gib']:.2f} GiB, RSS after "
              f"{self.parts[-1]['rss_after_gib']:.2f} GiB, {self.parts[-1]['seconds']:.0f} s", flush=True)
        self._reset()


def _model(args):
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False,
                                      attn_implementation="eager")
    base = transformers.Qwen2ForCausalLM(config)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(base, lora)
    return model, _input_ids(args)




def phase_export(args, meter: Meter) -> dict:
    import normgrad.torch

    model, input_ids = _model(args)
    parameters = sum(p.numel() for p in model.parameters())
    meter.mark("torch + peft model built")
    normgrad.torch.export(normgrad.torch.causal_lm_logits(model), (input_ids,), os.path.join(args.folder, "forward.onnx"), exporter="dynamo",
                          input_names=["input_ids"], output_names=["logits"], external_data=True)
    meter.mark("dynamo export, frozen base to forward.onnx.data")
    return {"parameters": parameters}


def phase_build(args, meter: Meter) -> dict:
    from normgrad.tools.export import main

    folder = args.folder
    code = main([os.path.join(folder, "forward.onnx"), "-o", os.path.join(folder, "step.onnx"), "--loss", "causal_lm",
                 "--optimizer", "adamw"])
    meter.mark("normgrad export (step graph, evaluation graph, checkpoint)")
    if code:
        raise SystemExit(f"normgrad export exited {code}")
    return {}


def phase_train(args, meter: Meter) -> dict:
    import numpy as np
    import onnxruntime as ort

    from normgrad.train import Trainer

    input_ids = _input_ids(args).numpy()
    folder = args.folder
    # the Trainer's default session options (memory patterns and weight pre-packing off)
    trainer = Trainer(os.path.join(folder, "step.onnx"), os.path.join(folder, "step.ckpt"), lr=args.lr)
    meter.mark("Trainer created (onnxruntime session)")
    losses = [trainer.step(input_ids=input_ids, labels=input_ids) for _ in range(args.steps)]
    meter.mark(f"{args.steps} steps")
    trainer.save_adapter(os.path.join(folder, "adapter"))
    meter.mark("save_adapter")
    if args.merged:
        trainer.export_merged_model(os.path.join(folder, "merged.onnx"))
        meter.mark("export_merged_model")
        session = ort.InferenceSession(os.path.join(folder, "merged.onnx"), providers=["CPUExecutionProvider"])
        logits = session.run(["logits"], {"input_ids": input_ids})[0]
        _save_array(os.path.join(folder, "merged_logits.npy"), logits)
        del session
        meter.mark("merged model run")
    return {"losses": [float(loss) for loss in losses]}


def _input_ids(args):
    import torch

    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))


def phase_torch(args, meter: Meter) -> dict:
    import torch

    model, input_ids = _model(args)
    meter.mark("torch + peft model built")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.01)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    meter.mark(f"{args.steps} steps")
    if args.merged:
        import numpy as np

        with torch.no_grad():
            merged = model.merge_and_unload()
            logits = merged(input_ids=input_ids, use_cache=False).logits.numpy()
        _save_array(os.path.join(args.folder, "torch_merged_logits.npy"), logits)
        meter.mark("merge_and_unload + logits")
    return {"losses": losses}


PHASES = {"export": phase_export, "build": phase_build, "train": phase_train, "torch": phase_torch}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=[*PHASES, "all"])
    parser.add_argument("--folder", required=True, help="where the model files go")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--merged", action="store_true", help="also write and run the merged model (train, torch)")
    args = parser.parse_args(argv)
    os.makedirs(args.folder, exist_ok=True)
    if args.phase != "all":
        meter = Meter()
        result = PHASES[args.phase](args, meter)
        result.update(phase=args.phase, parts=meter.parts, peak_rss_gib=max(p["peak_rss_gib"] for p in meter.parts))
        write_bytes_atomic(os.path.join(args.folder, f"{args.phase}.json"), json.dumps(result, indent=1).encode())
        return 0
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "all"]
    results = {}
    for phase in PHASES:
        print(f"{phase}:", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), phase, *passed], check=True)
        with open(os.path.join(args.folder, f"{phase}.json")) as file:
            results[phase] = json.load(file)
    ours, theirs = results["train"]["losses"], results["torch"]["losses"]
    print(f"{results['export']['parameters']:,} parameters")
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        print(f"step {step}: normgrad loss {a:.6f}, torch + peft {b:.6f}, difference {abs(a - b):.2e}")
    for phase, result in results.items():
        print(f"{phase}: peak RSS {result['peak_rss_gib']:.2f} GiB")
    sizes = {name: os.path.getsize(os.path.join(args.folder, name)) for name in sorted(os.listdir(args.folder))
             if os.path.isfile(os.path.join(args.folder, name))}
    print("files:", ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in sizes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
