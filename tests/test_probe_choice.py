"""The blocks a probe records (flt_diag.watch): blocks="auto" leaves out a reused module whose output is not the
stream (an ACT halting unit), refuses two separate loops with the blocks= to give, a block tied ALBERT-style to a
module object of each loop is refused; a watch() of a model another probe still watches lets go of that one; the
run folder may itself be a link."""
import pytest
import torch
import torch.nn as nn

import flt_diag
from probe_models import D, V, batches, lm_loss
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import folder_lock, load_config, load_metrics


def layer() -> nn.Module:
    return nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)


class Halting(nn.Module):
    """ACT-style: one layer looped `loops` times; a halting unit nn.Linear(D, 1) reads the stream before each loop
    and weighs the loop's output."""

    def __init__(self, loops: int = 3):
        super().__init__()
        self.loops, self.embed, self.layer, self.halt, self.head = loops, nn.Embedding(V, D), layer(), \
            nn.Linear(D, 1), nn.Linear(D, V)

    def forward(self, x):
        h, out = self.embed(x), 0
        for _ in range(self.loops):
            p = torch.sigmoid(self.halt(h))
            h = self.layer(h)
            out = out + p * h
        return self.head(out)


class TwoLoops(nn.Module):
    """An encoder layer looped 3 times, then a decoder layer looped 2 times: two separate loops."""

    def __init__(self):
        super().__init__()
        self.embed, self.enc, self.dec, self.head = nn.Embedding(V, D), layer(), layer(), nn.Linear(D, V)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(3):
            h = self.enc(h)
        for _ in range(2):
            h = self.dec(h)
        return self.head(h)


class TiedCopies(nn.Module):
    """ALBERT-style: 3 copies of one layer, their weights tied to the first's, one copy a loop; an nn.Identity
    ends each loop."""

    def __init__(self, loops: int = 3):
        super().__init__()
        self.embed, self.head, self.boundary = nn.Embedding(V, D), nn.Linear(D, V), nn.Identity()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(loops))
        for copy in self.layers[1:]:
            copy.weight, copy.bias = self.layers[0].weight, self.layers[0].bias

    def forward(self, x):
        h = self.embed(x)
        for copy in self.layers:
            h = self.boundary(h + torch.tanh(copy(h)))
        return self.head(h)


def train(model, folder, steps: int = 2, **options):
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    with flt_diag.watch(model, folder=folder, optimizer=opt, **options) as probe:
        for x in batches(steps):
            lm_loss(model(x), x).backward()
            opt.step()
            probe.step()
            opt.zero_grad()
    return probe


def hooks_on(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_auto_leaves_out_a_halting_unit(tmp_path, capfd):
    """The halting unit is called each loop too, but maps the stream (4, 8, 16) to (4, 8, 1): left out, said; the
    layer's records are the stream's norms after each loop, computed by hand."""
    torch.manual_seed(0)
    model = Halting(loops=3)
    x = batches(1)[0]
    with torch.no_grad():
        h, norms = model.embed(x), []
        for _ in range(3):
            h = model.layer(h)
            norms.append(float(torch.linalg.vector_norm(h, dim=-1).mean()))
    train(model, tmp_path / "act", loss=lambda out: lm_loss(out, x), blocks="auto")
    err = capfd.readouterr().err
    assert "left out halt ((4, 8, 16) -> (4, 8, 1))" in err and "chose layer (" in err
    assert load_config(tmp_path / "act").model.depth == 1
    df = load_metrics(tmp_path / "act")
    rows = df[(df.step == 0) & (df.metric == M.RESID_NORM)].sort_values("loop")
    assert list(rows.layer) == [1, 1, 1] and list(rows.loop) == [1, 2, 3]
    assert list(rows.value) == pytest.approx(norms, rel=1e-5)


def test_auto_refuses_when_no_reused_module_returns_the_stream(tmp_path):
    class OnlyHalt(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.halt = nn.Embedding(V, D), nn.Linear(D, 1)

        def forward(self, x):
            h = self.embed(x)
            return sum(self.halt(h).mean() for _ in range(3))

    model = OnlyHalt()
    with pytest.raises(flt_diag.ProbeError, match=r"^blocks='auto': no module the forward reuses returns a stream "
                                                  r"of a shape they take \(halt \(\(4, 8, 16\) -> \(4, 8, 1\)\)\)"):
        train(model, tmp_path / "halt", loss=lambda out: out)
    assert hooks_on(model) == 0 and not (tmp_path / "halt").exists()


def test_auto_refuses_two_separate_loops_saying_what_to_give(tmp_path):
    torch.manual_seed(0)
    model = TwoLoops()
    with pytest.raises(flt_diag.ProbeError, match=r"^blocks='auto': the forward runs 2 separate loops \(enc 3 "
                       r"times, then dec 2 times\); .* blocks=\[model\.enc\] or blocks=\[model\.dec\]$"):
        train(model, tmp_path / "two", loss=lambda out: out.mean())
    assert hooks_on(model) == 0 and not (tmp_path / "two").exists()
    train(model, tmp_path / "two", loss=lambda out: out.mean(), blocks=[model.enc])  # (as the line says)
    df = load_metrics(tmp_path / "two")
    assert set(df[df.metric == M.RESID_NORM].loop) == {1, 2, 3} and (df[df.metric == M.LOOPS_RUN].value == 3).all()


def test_a_block_tied_to_a_copy_each_loop_is_refused(tmp_path):
    """ALBERT-style tied copies: the first copy given as the block, loops counted at a boundary, would record loop
    1 only (the other loops call the other copies): refused at watch(), nothing made."""
    model = TiedCopies(loops=3)
    with pytest.raises(flt_diag.ProbeError, match=r"^block layers\.0 shares its weights with layers\.1, a module "
                                                  r"outside the blocks \(copies of one layer tied ALBERT-style"):
        flt_diag.watch(model, blocks=[model.layers[0]], folder=tmp_path / "tied", loop_boundary=model.boundary)
    assert hooks_on(model) == 0 and not (tmp_path / "tied").exists()


def test_a_second_watch_lets_go_of_a_probe_left_open(tmp_path, capfd):
    """A probe never closed (its loop raised between forwards): a watch() of the same model lets go of it - its
    hooks go (the model ends with only the new probe's), its folder is unlocked, its rows stay - said once."""
    torch.manual_seed(0)
    model = Halting(loops=2)
    x = batches(1)[0]
    fresh = flt_diag.watch(Halting(loops=2), blocks="layer", folder=tmp_path / "fresh")
    alone = hooks_on(fresh.model)  # (one probe's hooks, on a model of the same class)
    fresh.close()
    old = flt_diag.watch(model, blocks="layer", folder=tmp_path / "old")
    lm_loss(model(x), x).backward()
    old.step()
    capfd.readouterr()
    new = flt_diag.watch(model, blocks="layer", folder=tmp_path / "new")
    err = capfd.readouterr().err
    assert err.count("still carried the hooks of the probe writing") == 1 and str(tmp_path / "old") in err
    assert hooks_on(model) == alone > 0
    with folder_lock(tmp_path / "old"):
        pass
    assert list(load_metrics(tmp_path / "old").step.unique()) == [0]
    with pytest.raises(flt_diag.ProbeError, match="this probe is closed"):
        old.step()
    new.close()
    assert hooks_on(model) == 0


def test_the_run_folder_may_be_a_link(tmp_path):
    """watch(folder=) given a link to a folder (as a run folder on the command line may be) writes into its target."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target", target_is_directory=True)
    torch.manual_seed(0)
    model = Halting(loops=2)
    x = batches(1)[0]
    probe = train(model, tmp_path / "link", loss=lambda out: lm_loss(out, x), blocks="layer")
    assert probe.summary is not None and (tmp_path / "target" / "summary.json").is_file()
    assert sorted(load_metrics(tmp_path / "target").step.unique()) == [0, 1]


def test_two_separate_loops_given_as_blocks_are_refused_saying_what_to_give(tmp_path):
    torch.manual_seed(0)
    model = TwoLoops()
    with pytest.raises(flt_diag.ProbeError, match=r"^enc ran 2 times while dec ran 0 times: .* two separate loops\? "
                                                  r"give blocks= the blocks of one\)$"):
        train(model, tmp_path / "two", loss=lambda out: out.mean(), blocks=[model.enc, model.dec])
    assert hooks_on(model) == 0 and not (tmp_path / "two").exists()
