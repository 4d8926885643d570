"""flt_diag.watch on a looped model of one's own, trained by a plain PyTorch loop (about 10 s on a CPU).

    python examples/plain_loop.py          # writes runs/mine, then: flt-diag summary runs/mine

The model is a Universal Transformer: one transformer layer run 4 times (an nn.Sequential holding the same
layer four times between the embedding and the head). The README's snippet is the part between the two
`# readme` marks, verbatim (tests/test_examples.py checks it; tests/test_readme_snippet.py runs the README's
copy as pasted into a fresh interpreter).
"""
# readme:start
import torch, torch.nn as nn, torch.nn.functional as F, flt_diag
layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)   # one layer run 4 times:
model = nn.Sequential(nn.Embedding(64, 32), *[layer] * 4, nn.Linear(32, 64))   # a Universal Transformer
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
batches = [(x, (x + 1) % 64) for x in torch.randint(0, 64, (60, 8, 16))]   # learn "next token = x + 1"
with flt_diag.watch(model, blocks="auto", folder="runs/mine", optimizer=opt) as probe:
    for x, y in batches:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward(); opt.step()
        rows = probe.step(loss=loss); opt.zero_grad()   # after each optimizer step (rows: its records)

print(probe.summary.verdict)         # runs/mine reads as any run: flt-diag summary / plot / report / predict
# readme:end
