"""flt-diag's callback in a Lightning Trainer, on a Universal Transformer (about 20 s on a CPU).

    pip install 'flt-diag[lightning]' && python examples/lightning_module.py     # writes runs/pl

One shared nn.TransformerDecoderLayer (self-attention on the stream, cross-attention to the embedded
input) run 4 times, in a LightningModule; Lightning clips the gradients (gradient_clip_val) after the
callback has read them.
"""
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from flt_diag.integrations.lightning import FltDiagCallback

V, WIDTH, LOOPS = 64, 32, 4


class UniversalTransformer(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(V, WIDTH), nn.Linear(WIDTH, V)
        self.layer = nn.TransformerDecoderLayer(WIDTH, 2, 64, dropout=0.0, batch_first=True)

    def step(self, h, e):  # one loop: h(t-1) -> h(t), the input e injected by cross-attention
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1])
        return self.layer(h, e, tgt_mask=mask, memory_mask=mask, tgt_is_causal=True, memory_is_causal=True)

    def forward(self, x):
        e = h = self.embed(x)
        for _ in range(LOOPS):
            h = self.step(h, e)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


torch.manual_seed(0)
module = UniversalTransformer()
g = torch.Generator().manual_seed(0)
data = [(x, (x + 1) % V) for x in torch.randint(0, V, (60, 8, 16), generator=g)]  # learn "next = x + 1"
callback = FltDiagCallback(blocks="layer", folder="runs/pl", seed=0)
trainer = L.Trainer(max_steps=60, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0, callbacks=[callback])
trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
print(callback.summary.verdict)  # runs/pl reads as any run: flt-diag summary runs/pl
