"""flt_diag.watch on a looped model of one's own, trained by a plain PyTorch loop (about 10 s on a CPU).

    python examples/plain_loop.py          # writes runs/mine, then: flt-diag summary runs/mine

The model is a Universal Transformer: one transformer layer run 4 times. The README's snippet is the part
between the two `# readme` marks, verbatim (tests/test_examples.py checks it).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Looped(nn.Module):
    """One causal transformer layer run `loops` times on the embedded tokens, then a linear head."""

    def __init__(self, vocab: int = 64, width: int = 32, loops: int = 4):
        super().__init__()
        self.loops, self.embed, self.head = loops, nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.layer = nn.TransformerEncoderLayer(width, 2, 64, dropout=0.0, batch_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.embed(x)
        for _ in range(self.loops):
            h = self.layer(h, src_mask=mask, is_causal=True)
        return self.head(h)


# readme:start
import flt_diag                      # (Looped: one transformer layer run 4 times; examples/plain_loop.py)
model = Looped(loops=4)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
batches = [(x, (x + 1) % 64) for x in torch.randint(0, 64, (60, 8, 16))]   # learn "next token = x + 1"
loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())
with flt_diag.watch(model, blocks="auto", folder="runs/mine", optimizer=opt) as probe:
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward(); opt.step()
        probe.step(loss=loss)        # after each optimizer step
        opt.zero_grad()
print(probe.summary["verdict"])      # runs/mine reads as any run: flt-diag summary / plot / report / predict
# readme:end
