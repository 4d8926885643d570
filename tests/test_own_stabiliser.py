"""A researcher's own stabiliser from outside the package (issue 65): registered by one call it is a variant for the
model, the config's validation, the Trainer (config.json names it) and `flt-diag variants`; named by an entry point
it is one for the command line; the example of docs/extending.md runs as written."""
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from equations import block_forward, randomize, rms
from flt_diag.config.option_fields import ConfigError
from flt_diag.config.variants import VARIANTS, unregister_stabiliser
from flt_diag.model.transformer import LoopedTransformer, ModelConfig
from flt_diag.training.trainer import Trainer

import flt_diag

REPO = Path(__file__).resolve().parents[1]


def halfway(part, x_in, x_out, t):  # the toy: each loop moves (1 + w_t) / 2 of the way, w_t learned
    return x_in + (0.5 + part.w[t]) * (x_out - x_in)


TOY = flt_diag.Stabiliser(name="toy-halfway", description="x_in + (1/2 + w_t)(F(x_in) - x_in)", source="this test",
                          composes=True, ours={"w": "0 at init"}, part="halfway", update=halfway,
                          parameters=lambda cfg: torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(cfg.loops))}))


@pytest.fixture
def toy():
    flt_diag.register_stabiliser(TOY)
    yield TOY
    unregister_stabiliser(TOY.name)


def test_a_registered_stabiliser_is_a_variant_its_forward_the_written_out_loop(toy):
    assert "toy-halfway" in VARIANTS and "flt+toy-halfway" in VARIANTS
    cfg = ModelConfig(vocab_size=50, depth=2, width=16, heads=2, seq_len=16, variant="toy-halfway", loops=3)
    model = randomize(LoopedTransformer(cfg)).double()
    idx = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    h = x = rms(model.embed.weight[idx])  # LT written out, the toy's update by hand
    for t in range(3):
        x_in = x = h
        for block in model.blocks:
            x = block_forward(block, x, 2)
        x = x_in + (0.5 + model.halfway.w[t]) * (x - x_in)
        h = rms(x)
    torch.testing.assert_close(model(idx).double(), 15 * torch.tanh(h @ model.head.weight.T / 15), rtol=1e-5, atol=1e-5)


def test_an_unknown_variant_is_one_line_and_a_taken_name_is_refused(toy):
    with pytest.raises(ValueError, match=r"^.*variant.*must be one of lt, .*toy-halfway.*got 'toy-halfwy'$"):
        ModelConfig.of(variant="toy-halfwy")
    with pytest.raises(ValueError, match="named flt"):
        flt_diag.register_stabiliser(flt_diag.Stabiliser(name="flt", description="", source=""))
    assert "flt+toy-halfway" in VARIANTS  # (the refused one left the tables as they were)


def test_a_registered_stabiliser_trains_and_its_run_names_it(toy, tmp_path):
    Trainer(tiny_config(variant="flt+toy-halfway", loops=2, steps=2), tmp_path / "run").fit()
    record = json.loads((tmp_path / "run" / "config.json").read_text())["env"]["stabiliser"]
    assert record["name"] == "toy-halfway" and record["module"] == __name__ and record["file"] == __file__


def test_the_variants_command_lists_a_registered_stabiliser_with_its_choices(toy, capsys):
    from flt_diag.cli import main
    assert main(["variants"]) == 0
    out = capsys.readouterr().out
    assert f"from {__name__} (not flt-diag's own)" in out and "ours: w: 0 at init" in out and "flt+toy-halfway" in out


def test_an_entry_point_makes_a_stabiliser_known_to_the_command_line(tmp_path):
    (tmp_path / "mystab.py").write_text("from flt_diag import Stabiliser\nMINE = Stabiliser(name='mine', "
                                        "description='nothing', source='a plugin', block=lambda cfg: {})\n")
    info = tmp_path / "mystab-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mystab\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text("[flt_diag.stabilisers]\nmine = mystab:MINE\n")
    env = {"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "flt_diag", "variants"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert re.search(r"  mine +nothing\n.*on lt; a plugin\n +from mystab ", run.stdout)
    code = "from flt_diag.model.stabilisers import provenance; from flt_diag.config.variants import STABILISERS; " \
           "print(provenance(STABILISERS['mine'])['version'])"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120).stdout.strip() == "1.2"


def test_the_example_of_docs_extending_runs_as_written():
    text = (REPO / "docs" / "extending.md").read_text()
    section = text[text.index("## Your own stabiliser"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["torch.Size([1,", "8,", "256])", str(3 * 64)]


def test_watch_takes_a_registered_stabiliser_as_its_variant_and_refuses_an_unknown_one(toy, tmp_path):
    model = LoopedTransformer(ModelConfig(vocab_size=64, depth=1, width=16, heads=2, seq_len=8, variant="toy-halfway",
                                          loops=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(flt_diag.ProbeError, match="watch.variant='toy-halfwy'.: one of flt-diag's variants"):
        flt_diag.watch(model, blocks=model.blocks, folder=tmp_path / "bad", optimizer=opt, variant="toy-halfwy")
    probe = flt_diag.watch(model, blocks=model.blocks, folder=tmp_path / "w", optimizer=opt, variant="toy-halfway",
                           loss=lambda out: out[1], steps=2)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.zero_grad()
        model(tokens, tokens)[1].backward()
        probe.step()
    probe.close()
    assert json.loads((tmp_path / "w" / "config.json").read_text())["model"]["variant"] == "toy-halfway"


@pytest.mark.parametrize("target, said", [("nosuchmodule:X", "ModuleNotFoundError"),
                                          ("json:dumps", "a stabiliser is a flt_diag Stabiliser"),
                                          ("exits:X", "SystemExit: 4")])  # (a module that calls sys.exit(4))
def test_a_broken_entry_point_is_one_warning_line_and_left_out(tmp_path, target, said):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(4)\n")
    info = tmp_path / "broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[flt_diag.stabilisers]\nbroken = {target}\n")
    run = subprocess.run([sys.executable, "-m", "flt_diag", "train", "--variant", "broken"], capture_output=True,
                         text=True, env={"PYTHONPATH": f"{REPO}:{tmp_path}", "PATH": "/usr/bin:/bin"}, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and "Traceback" not in run.stderr and len(lines) == 2, run.stderr
    assert lines[0].startswith(f"warning: stabiliser entry point broken = {target} left out") and said in lines[0]
    assert lines[1].startswith("error: --variant must be one of lt,") and lines[1].endswith("got 'broken'")
