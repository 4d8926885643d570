"""flt_diag.watch stores the user's recipe as the user ran it (no flt-diag defaults, no default warm-down),
every reader reads new and old watch folders, and the leftovers of issue 42: targets from the batch's labels,
a reentrant checkpoint said, tied blocks refused, parameter groups and the head found by structure."""
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from pydantic import ValidationError

import flt_diag
from probe_models import D, V, UniversalTransformer, batches, check_folder, lm_loss
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_metrics


def run(model, folder, steps=6, opt=None, **options):
    opt = opt or torch.optim.AdamW(model.parameters(), 1e-3)
    with flt_diag.watch(model, folder=folder, optimizer=opt, steps=steps, **options) as probe:
        for x in batches(steps):
            loss = lm_loss(model(x), x)
            loss.backward()
            opt.step()
            probe.step(loss=loss)
            opt.zero_grad()
    return probe


def test_the_recipe_is_the_users_and_no_warm_down_is_assumed(tmp_path):
    model = UniversalTransformer()
    opt = torch.optim.AdamW([{"params": model.layer.parameters(), "lr": 3e-3, "weight_decay": 0.1},
                             {"params": [*model.embed.parameters(), *model.head.parameters()], "lr": 1e-2}],
                            betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, 100)
    probe = run(model, tmp_path / "new", steps=20, opt=opt, scheduler=sched, grad_clip=0.5)
    cfg = json.loads((tmp_path / "new" / "config.json").read_text())
    r = cfg["probe"]["recipe"]
    assert (r["optimizer"], r["scheduler"], r["steps"], r["grad_clip"], r["warmdown"], r["variant"]) == \
        ("AdamW", "StepLR", 20, 0.5, None, None)
    assert r["param_groups"] == [dict(lr=3e-3, betas=[0.8, 0.95], weight_decay=0.1),
                                 dict(lr=1e-2, betas=[0.8, 0.95], weight_decay=0.01)]
    assert cfg["train"] == dict(steps=20, batch_size=4, device="cpu", grad_clip=0.5)  # given or observed, no more
    assert "variant" not in cfg["model"] and cfg["model"]["loops"] == 3 and cfg["model"]["width"] == D
    assert not {"matrix_lr", "optimizer", "momentum", "softcap"} & {*cfg["train"], *cfg["model"]}  # no flt-diag recipe
    assert cfg["n_params"] == sum(p.numel() for p in model.parameters())
    s = probe.summary
    assert [m.step for m in s.milestones] == [0, 19]  # no warm-down: its milestone is the last step
    assert s.evidence.warmdown.startswith("none given") and s.variant is None
    check_folder(tmp_path / "new")  # summary, --recompute, plot all, report, predict
    again = json.loads((tmp_path / "new" / "summary.json").read_text())
    assert again["evidence"]["warmdown"] == s.evidence.warmdown
    assert [m["step"] for m in again["milestones"]] == [0, 19]  # recomputed without a warm-down: none was given


def test_the_probes_host_holds_the_users_recipe_and_no_made_up_run_config(tmp_path):
    probe = run(UniversalTransformer(), tmp_path / "r", steps=5)
    host = probe.host
    assert not hasattr(host, "cfg")  # no RunConfig of flt-diag's defaults in memory (issue 65 part 4)
    r = host.recipe
    assert r.seed is None and r.lr_scale is None  # not given: not made up (the old stand-in said 0 and 1.0)
    assert (r.steps, r.loops, r.width) == (5, 3, D)  # observed: UniversalTransformer's 3 loops of width D


def test_a_warm_down_given_moves_the_window_the_verdict_judges(tmp_path):
    probe = run(UniversalTransformer(), tmp_path / "wd", steps=20, warmdown=0.25, seed=3)
    assert [m.step for m in probe.summary.milestones] == [0, 20 - 5, 19]
    assert "25%" in probe.summary.evidence.warmdown
    cfg = json.loads((tmp_path / "wd" / "config.json").read_text())
    assert cfg["train"] == dict(steps=20, batch_size=4, device="cpu", seed=3, warmdown_frac=0.25)  # as given
    check_folder(tmp_path / "wd")
    assert [m["step"] for m in json.loads((tmp_path / "wd" / "summary.json").read_text())["milestones"]] == [0, 15, 19]


def old_folder(new, old):
    """A watch folder as the previous release wrote it: flt-diag's default recipe, variant "lt", the 20 % warm-down."""
    from flt_diag.config.run_config import ModelConfig, RunConfig, TrainConfig
    old.mkdir()
    cfg = json.loads((new / "config.json").read_text())
    m, t = cfg["model"], cfg["train"]
    stored = RunConfig(model=ModelConfig(**{**m, "variant": "lt"}), train=TrainConfig(
        steps=t["steps"], batch_size=t["batch_size"], seed=0, data="external", tokenizer=None, device="cpu",
        eval_every=0, checkpoint_every=0, grad_clip=0), diagnostics=cfg["diagnostics"]).to_dict()
    probe = {k: v for k, v in cfg["probe"].items() if k not in ("recipe", "not_recorded")}
    (old / "config.json").write_text(json.dumps({**stored, "n_params": cfg["n_params"], "env": cfg["env"],
                                                 "note": "the train section's recipe fields are flt-diag's defaults",
                                                 "probe": probe}))
    summary = json.loads((new / "summary.json").read_text())
    summary["evidence"].pop("warmdown")
    (old / "summary.json").write_text(json.dumps({**summary, "variant": "lt"}))
    (old / "metrics").mkdir()
    for part in (new / "metrics").iterdir():
        (old / "metrics" / part.name).write_bytes(part.read_bytes())


def test_old_watch_folders_are_still_read(tmp_path):
    run(UniversalTransformer(), tmp_path / "new", steps=20)
    old_folder(tmp_path / "new", tmp_path / "old")
    check_folder(tmp_path / "old")
    resummarized = json.loads((tmp_path / "old" / "summary.json").read_text())
    assert [m["step"] for m in resummarized["milestones"]] == [0, 16, 19]  # its own stored 20 %, as it was judged
    assert resummarized["variant"] == "lt"
    check_folder(tmp_path / "new")
    from flt_diag.results.tables import collect
    assert [r.id.variant for r in collect(tmp_path / "old").runs + collect(tmp_path / "new").runs] == ["lt", "own"]


def test_the_hf_schedule_gives_the_warm_down():
    from flt_diag.integrations.hf import labels_of, warmdown
    from transformers import TrainingArguments
    args = lambda **kw: TrainingArguments(output_dir="/tmp/unused", report_to=[], **kw)  # noqa: E731
    assert warmdown(args(lr_scheduler_type="linear", warmup_steps=10), 100) == pytest.approx(0.9)
    assert warmdown(args(lr_scheduler_type="constant_with_warmup", warmup_steps=10), 100) is None
    assert warmdown(args(lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs=dict(num_decay_steps=20)),
                    100) == pytest.approx(0.2)
    labels = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert labels_of(True, labels=labels).tolist() == [[2, 3, -100], [5, 6, -100]]  # as a causal LM's loss shifts
    assert labels_of(False, labels=labels) is labels and labels_of(True, torch.ones(2)) is None


def test_a_lightning_batch_gives_its_target():
    pytest.importorskip("lightning")
    from flt_diag.integrations.lightning import batch_target
    x, y = torch.zeros(2, 3), torch.ones(2, 3)
    assert batch_target((x, y)) is y and batch_target({"input": x, "labels": y}) is y
    assert batch_target(x) is None and batch_target({"input": x}) is None


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.embed, self.block, self.head, self.reentrant = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V), reentrant

    def forward(self, x):
        h = self.embed(x)
        for _ in range(3):
            h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


def test_a_reentrant_checkpoint_is_said_and_marked_not_recorded(tmp_path, capfd):
    probe = run(Checkpointed(reentrant=True), tmp_path / "re", blocks="block")
    err = capfd.readouterr().err
    assert err.count("not recorded: block ran without gradient") == 1 and "use_reentrant=True" in err
    df = load_metrics(tmp_path / "re")
    assert not (df.metric == "act_grad_norm").any()  # no rows: never zeros
    assert "act_grad_norm" in json.loads((tmp_path / "re" / "config.json").read_text())["probe"]["not_recorded"]
    assert probe.summary.evidence.not_recorded["act_grad_norm"].startswith("block ran without gradient")
    run(Checkpointed(reentrant=False), tmp_path / "non", blocks="block")
    assert "not recorded" not in capfd.readouterr().err
    assert (load_metrics(tmp_path / "non").metric == "act_grad_norm").sum() > 0


def test_blocks_with_tied_weights_are_refused(tmp_path):
    a, b = nn.Linear(D, D), nn.Linear(D, D)
    b.weight = a.weight
    model = nn.Sequential(a, b, a, b)
    with pytest.raises(flt_diag.ProbeError, match=r"blocks 0 and 1 share parameters \(weights tied across two"):
        flt_diag.watch(model, blocks=[a, b], folder=tmp_path / "tied")
    assert not (tmp_path / "tied").exists()


class Mixer(nn.Module):  # an attention module whose name says nothing: its children compute q, k, v
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, h):
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class Block(nn.Module):
    def __init__(self, mha: bool):
        super().__init__()
        self.mixer = nn.MultiheadAttention(D, 2, batch_first=True) if mha else Mixer()
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.mha = mha

    def forward(self, h):
        h = h + (self.mixer(h, h, h, need_weights=False)[0] if self.mha else self.mixer(h))
        return h + self.ff(h)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(mha=False), Block(mha=True)])
        self.decoder = nn.Module()
        self.decoder.norm, self.decoder.out = nn.LayerNorm(D), nn.Linear(D, V)  # a head that is not at the top

    def forward(self, x):
        h = self.embed(x)
        for _ in range(2):
            for b in self.blocks:
                h = b(h)
        return self.decoder.out(self.decoder.norm(h))


def test_parameter_groups_and_the_head_are_found_by_structure(tmp_path):
    model = Nested()
    probe = flt_diag.watch(model, blocks="blocks.*", folder=tmp_path / "g")
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(probe.groups["head"]) == ids(model.decoder.out.parameters())
    assert ids(probe.groups["block0.attn"]) == ids(model.blocks[0].mixer.parameters())
    assert ids(probe.groups["block1.attn"]) == ids(model.blocks[1].mixer.parameters())
    assert ids(probe.groups["block0.mlp"]) == ids(model.blocks[0].ff.parameters())
    assert ids(probe.groups["other"]) == ids(model.decoder.norm.parameters())
    probe.close()


class FlatBlock(nn.Module):
    """Attention and MLP as the block's own children (qkv, proj beside fc1, fc2 and the norms)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, h):
        q, k, v = self.qkv(self.ln1(h)).chunk(3, -1)
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


def test_a_flat_blocks_attention_is_its_qkv_and_output_projection(tmp_path):
    model = Nested()
    model.blocks = nn.ModuleList([FlatBlock(), FlatBlock()])
    probe = flt_diag.watch(model, blocks="blocks.*", folder=tmp_path / "g")
    ids = lambda *ms: {id(p) for m in ms for p in m.parameters()}  # noqa: E731
    for i, b in enumerate(model.blocks):
        assert {id(p) for p in probe.groups[f"block{i}.attn"]} == ids(b.qkv, b.proj)
        assert {id(p) for p in probe.groups[f"block{i}.mlp"]} == ids(b.ln1, b.ln2, b.fc1, b.fc2)
    probe.close()


def test_the_results_are_typed_and_read_only(tmp_path):
    probe = run(UniversalTransformer(), tmp_path / "t", warn=True)
    on_disk = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert probe.summary.verdict == on_disk["verdict"] and probe.summary.steps_done == on_disk["steps_done"] == 6
    assert probe.summary.as_written().keys() == on_disk.keys()  # the fields written
    with pytest.raises(ValidationError):
        probe.summary.verdict = "stable"  # type: ignore[misc]
    w = flt_diag.EarlyWarning(step=25, p_collapse=0.4, threshold=0.5, evidence="loss")
    assert w.model_dump() == dict(step=25, p_collapse=0.4, threshold=0.5, evidence="loss") and w.p_collapse == 0.4
    with pytest.raises(ValidationError):
        w.p_collapse = 0.9  # type: ignore[misc]
    model = UniversalTransformer()
    with flt_diag.watch(model, folder=tmp_path / "rows") as probe:
        x = batches(1)[0]
        lm_loss(model(x), x).backward()
        rows = probe.step(loss=1.5)
    loss = next(r for r in rows if r.metric == "loss")
    assert (loss.step, loss.loop, loss.layer, loss.value) == (0, -1, -1, 1.5) and tuple(loss) == (0, "loss", -1, -1, 1.5)


def test_a_summary_whose_oscillation_could_not_be_judged_says_why(tmp_path):
    """A warm-down over every step (an HF linear schedule), or too few steps for one window: the oscillation index is
    NaN and the evidence says it was not judged, and why; a run long enough is judged and says nothing."""
    everything = run(UniversalTransformer(), tmp_path / "w", steps=30, warmdown=1.0).summary
    assert math.isnan(everything.osc_dlog_median) and everything.evidence.osc_windows_judged == 0
    assert everything.evidence.oscillation.startswith("not judged: no window of 20 consecutive") and \
        "leaves too few before it" in everything.evidence.oscillation
    short = run(UniversalTransformer(), tmp_path / "s", steps=12).summary
    assert short.evidence.osc_windows_judged == 0 and "not judged" in short.evidence.oscillation and \
        short.evidence.oscillation.endswith("(too few recorded steps)")
    judged = run(UniversalTransformer(), tmp_path / "j", steps=30).summary
    assert judged.evidence.osc_windows_judged >= 1 and judged.evidence.oscillation is None


class SampledLoops(nn.Module):
    """A core run r times, r drawn per forward from a given sequence (the first forward draws 1)."""

    def __init__(self, rs):
        super().__init__()
        self.embed, self.core, self.head, self.rs = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V), iter(rs)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(next(self.rs)):
            h = h + torch.tanh(self.core(h))
        return self.head(h)


def test_a_first_forward_of_one_loop_is_recorded_not_refused(tmp_path, capsys):
    """Given blocks, a sampled loop count of 1 at the first forward: said once, recorded as one loop, and the run
    goes on to its summary (issue 42)."""
    model = SampledLoops([1, 3, 2, 3, 3])
    probe = run(model, tmp_path / "r", steps=5, blocks=[model.core])
    assert probe.summary is not None and dict(probe.loops_seen) == {1: 1, 3: 3, 2: 1}
    df = load_metrics(tmp_path / "r")
    loops = {s: sorted(df[(df.step == s) & (df.metric == M.RESID_NORM)].loop) for s in range(5)}
    assert loops == {0: [1], 1: [1, 2, 3], 2: [1, 2], 3: [1, 2, 3], 4: [1, 2, 3]}
    assert capsys.readouterr().err.count("in the first recorded forward (a sampled loop count of 1?)") == 1


class SampledCore(SampledLoops):
    """SampledLoops with a prelude of two blocks in a ModuleList (what blocks="auto" fell back to)."""

    def __init__(self, rs):
        super().__init__(rs)
        self.prelude = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])

    def forward(self, x):
        h = self.embed(x)
        for layer in self.prelude:
            h = h + torch.tanh(layer(h))
        for _ in range(next(self.rs)):
            h = h + torch.tanh(self.core(h))
        return self.head(h)


def test_auto_chooses_the_blocks_at_the_first_forward_that_reuses_one(tmp_path, capsys):
    """blocks="auto", the first two forwards draw one loop: no choice yet (said once), those steps keep their loss and
    gradient norm; the third reuses the core: chosen, the loop records from there on, the run to its summary."""
    draws = [1, 1, 1, 1, 3, 3, 2, 3, 3, 3]  # (each training forward draws twice: auto's counting forward, then its own)
    model = SampledCore(draws)
    probe = run(model, tmp_path / "a", steps=4)
    err = capsys.readouterr().err
    assert err.count("no module was called twice in the first training forward") == 1 and "chose core" in err
    assert probe.names == ["core"] and probe.summary is not None
    df = load_metrics(tmp_path / "a")
    for metric in (M.LOSS, M.GRAD_NORM):
        assert sorted(df[(df.metric == metric) & (df.loop == M.NONE) & (df.layer == M.NONE)].step) == [0, 1, 2, 3]
    assert sorted(df[df.metric == M.RESID_NORM].step.unique()) == [2, 3]
    assert json.loads((tmp_path / "a" / "config.json").read_text())["probe"]["blocks"] == ["core"]
