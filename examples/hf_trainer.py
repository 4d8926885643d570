"""flt-diag's callback in a Hugging Face Trainer, on a looped Llama (about 30 s on a CPU).

    pip install 'flt-diag[hf-trainer]' && python examples/hf_trainer.py     # writes runs/hf

A Llama from a tiny config (nothing downloaded) whose two decoder layers are run 3 times: its layer list
repeats them (6 entries, 2 modules). blocks="auto" finds the two layers by their calls. The Trainer clips
the gradients (max_grad_norm, default 1.0) before any callback: the callback reads each gradient as the
backward accumulates it, before the clipping, so the oscillation index is of the unclipped norm.
"""
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from flt_diag.integrations.hf import FltDiagCallback

LOOPS, LAYERS = 3, 2
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
model = LlamaForCausalLM(config)
layers = list(model.model.layers)
model.model.layers = nn.ModuleList(layers * LOOPS)  # the loop: layer 1, 2, 1, 2, 1, 2
model.config.num_hidden_layers = LAYERS * LOOPS     # (Llama runs the first num_hidden_layers entries)
model.config.layer_types = [model.config.layer_types[0]] * (LAYERS * LOOPS) if getattr(
    model.config, "layer_types", None) else None

g = torch.Generator().manual_seed(0)
tokens = torch.randint(0, 64, (240, 16), generator=g)
data = [{"input_ids": x, "labels": x} for x in (tokens // 2) * 2]  # even tokens only: something to learn

callback = FltDiagCallback(blocks="auto", folder="runs/hf", seed=0)
args = TrainingArguments(output_dir="runs/hf-trainer", max_steps=60, per_device_train_batch_size=4, learning_rate=3e-3,
                         report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, logging_strategy="no",
                         dataloader_num_workers=0, seed=0)
Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
print(callback.summary.verdict)  # runs/hf reads as any run: flt-diag summary runs/hf
