"""Looped models flt-diag did not write, for the probe's tests (tests/test_probe.py, test_integrations.py), the
Hugging Face and Lightning trainers they run under,
and the CLI check every probe run folder must pass."""
import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, T = 32, 16, 8


class UniversalTransformer(nn.Module):
    """One torch.nn.TransformerEncoderLayer looped K times (a Universal Transformer)."""

    def __init__(self, loops: int = 3, sample_loops: bool = False):
        super().__init__()
        self.loops, self.sample_loops = loops, sample_loops
        self.embed = nn.Embedding(V, D)
        self.layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, V)
        self.sampled: list[int] = []

    def forward(self, x):
        h = self.embed(x)
        k = int(torch.randint(1, self.loops + 1, ()).item()) + 1 if self.sample_loops else self.loops
        self.sampled.append(k)
        for _ in range(k):
            h = self.layer(h)
        return self.head(h)


def lm_loss(logits, x):
    return F.cross_entropy(logits.flatten(0, 1), x.flatten())


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (4, T), generator=g) for _ in range(n)]


def lightning_module(loops: int = 3, skip: int | None = None):
    """A LightningModule of a UniversalTransformer (`net`) trained on lm_loss with AdamW; batch `skip`'s
    training_step returns None (Lightning's own way to skip a batch). Imports lightning: importorskip first."""
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = UniversalTransformer(loops=loops)

        def forward(self, x):
            return self.net(x)

        def training_step(self, x, batch_idx):
            loss = lm_loss(self(x), x)
            return None if batch_idx == skip else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), 1e-3)
    return Module()


def lightning_fit(module, callback, steps: int, n_batches: int, **trainer_options):
    """Lightning's Trainer on the CPU, quiet (no logger, checkpoints, bar or summary), `steps` steps over
    `n_batches` batches; returns the Trainer."""
    import lightning as L
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], **trainer_options)
    trainer.fit(module, torch.utils.data.DataLoader(batches(n_batches), batch_size=None))
    return trainer


def hf_fit(model, callbacks, out, steps: int, **args_options) -> None:
    """transformers' Trainer on the CPU, quiet (no report, checkpoint, bar or log unless `args_options` say), `steps`
    steps of 4 sequences of 16 tokens (input_ids = labels, seeded). Imports transformers: importorskip first."""
    import transformers
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (4 * steps, 16), generator=g)]
    args = transformers.TrainingArguments(**{**dict(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
        save_strategy="no", use_cpu=True, disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0),
        **args_options})
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()


def looped_gpt2(loops: int = 3):
    """The decoder blocks of a GPT-2 built from a config (width 64, 2 layers; nothing downloaded) run
    `loops` times; forward(input_ids, labels) returns {"loss", "logits"} as a Hugging Face model does."""
    from transformers import GPT2Config, GPT2LMHeadModel

    class LoopedGPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
            self.loops = loops

        def forward(self, input_ids, labels=None):
            t = self.gpt.transformer
            h = t.wte(input_ids) + t.wpe(torch.arange(input_ids.shape[1]))
            for _ in range(self.loops):
                for block in t.h:
                    out = block(h)
                    h = out[0] if isinstance(out, tuple) else out
            logits = self.gpt.lm_head(t.ln_f(h))
            loss = None if labels is None else F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return {"loss": loss, "logits": logits}

    return LoopedGPT2()


def check_folder(run_dir) -> None:
    """`flt-diag summary`, `summary --recompute`, `plot all`, `report` and `predict` on a run folder."""
    from flt_diag.cli import main
    for args in (["summary", str(run_dir)], ["summary", str(run_dir), "--recompute"],
                 ["plot", "all", str(run_dir), "--out", str(run_dir.parent / f"{run_dir.name}-figures")],
                 ["report", str(run_dir), "--out", str(run_dir.parent / f"{run_dir.name}-report")],
                 ["predict", str(run_dir)]):
        assert main(args) == 0, args
