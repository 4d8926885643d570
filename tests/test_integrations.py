"""The probe's callbacks: transformers' Trainer on looped GPT-2 blocks, Lightning on a Universal
Transformer; each run folder read by the CLI; an integration without its extra is one ImportError line."""
import subprocess
import sys

import pytest
import torch

from probe_models import check_folder, hf_fit, lightning_fit, lightning_module, looped_gpt2
from flt_diag.storage import metric_names as M
from flt_diag.storage.folders import load_config, load_metrics, load_summary


def test_hugging_face_trainer(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # (the Trainer needs it; the hf-trainer extra installs it)
    from flt_diag.integrations.hf import FltDiagCallback
    torch.manual_seed(0)
    model = looped_gpt2(loops=2)
    callback = FltDiagCallback(blocks="gpt.transformer.h.*", folder=tmp_path / "hf", head=model.gpt.lm_head)
    hf_fit(model, [callback], tmp_path / "out", steps=5)
    df = load_metrics(tmp_path / "hf")
    assert sorted(set(df[df.metric == M.LOSS].step)) == [0, 1, 2, 3, 4]
    assert set(df[df.metric == M.RESID_NORM].loop) == {1, 2} and set(df[df.metric == M.RESID_NORM].layer) == {1, 2}
    assert (df[df.metric == M.LOOPS_RUN].value == 2).all()
    assert len(df[df.metric == "grad_norm_clipped/attn"]) == 5 * 2  # read before the Trainer zeroes them
    assert load_summary(tmp_path / "hf").verdict == callback.summary.verdict
    assert load_config(tmp_path / "hf").train.steps == 5
    assert not model._forward_pre_hooks  # the hooks are gone after training
    check_folder(tmp_path / "hf")


def test_lightning(tmp_path):
    pytest.importorskip("lightning")
    from flt_diag.integrations.lightning import FltDiagCallback

    torch.manual_seed(0)
    module = lightning_module(loops=3)
    callback = FltDiagCallback(blocks="net.layer", folder=tmp_path / "pl")
    lightning_fit(module, callback, steps=5, n_batches=5, gradient_clip_val=0.05)
    df = load_metrics(tmp_path / "pl")
    assert sorted(set(df[df.metric == M.LOSS].step)) == [0, 1, 2, 3, 4]
    assert set(df[df.metric == M.RESID_NORM].loop) == {1, 2, 3}
    # gradients read before Lightning clips them (the global norm), and after (per group, 0.05 in all)
    for step in range(5):
        clipped = df[(df.step == step) & df.metric.str.startswith("grad_norm_clipped/")].value
        before = float(df[(df.step == step) & (df.metric == M.GRAD_NORM)].value.iloc[0])
        assert float((clipped ** 2).sum()) ** 0.5 == pytest.approx(0.05, rel=1e-4) and before > 0.06
    assert load_summary(tmp_path / "pl").verdict == callback.summary.verdict
    check_folder(tmp_path / "pl")


@pytest.mark.parametrize("module,blocked,extra", [("hf", "transformers", "hf-trainer"),
                                                   ("lightning", "lightning", "lightning")])
def test_an_integration_without_its_extra_is_one_line(module, blocked, extra):
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            f"import flt_diag.integrations.{module}")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode != 0
    assert last == (f"ImportError: flt_diag.integrations.{module} needs "
                    f"{'transformers>=4.40 and accelerate' if extra == 'hf-trainer' else 'lightning>=2.2'}: "
                    f"pip install 'flt-diag[{extra}]'")


def test_hugging_face_options_and_the_gradient_before_clipping(tmp_path):
    """seed= given to the callback wins over the Trainer's; under the Trainer's clipping the recorded gradient
    norm is the Trainer's own pre-clip norm (its log), and the per-group clipped norms make max_grad_norm."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from flt_diag.integrations.hf import FltDiagCallback

    class Logs(transformers.TrainerCallback):
        def __init__(self):
            self.grad_norm = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "grad_norm" in logs:
                self.grad_norm[state.global_step - 1] = float(logs["grad_norm"])

    torch.manual_seed(0)
    model = looped_gpt2(loops=2)
    callback, logs = FltDiagCallback(blocks="gpt.transformer.h.*", folder=tmp_path / "hf", seed=7), Logs()
    hf_fit(model, [callback, logs], tmp_path / "out", steps=4, logging_strategy="steps", logging_steps=1,
           max_grad_norm=0.1)
    assert load_config(tmp_path / "hf").train.seed == 7
    df = load_metrics(tmp_path / "hf")
    assert sorted(logs.grad_norm) == [0, 1, 2, 3]
    for step, norm in logs.grad_norm.items():
        assert norm > 0.2  # (clipped to 0.1: the clipping acted)
        assert float(df[(df.step == step) & (df.metric == M.GRAD_NORM)].value.iloc[0]) == pytest.approx(norm, rel=1e-4)
        clipped = df[(df.step == step) & df.metric.str.startswith("grad_norm_clipped/")].value
        assert float((clipped ** 2).sum()) ** 0.5 == pytest.approx(0.1, rel=1e-3)
        groups = df[(df.step == step) & df.metric.str.startswith("grad_norm/")].value  # per group, before clipping
        assert float((groups ** 2).sum()) ** 0.5 == pytest.approx(norm, rel=1e-4)
    # (read before the clipping: not refused for it; the Trainer's linear schedule makes every step warm-down, so no
    # window of rule 4b lies before it, and the evidence says so)
    said = callback.summary.evidence.oscillation
    assert "clipped" not in said and "a warm-down of the last 100% of the steps leaves too few" in said


def test_lightning_options_win(tmp_path):
    """steps= and optimizer= given to the callback are watch()'s, not a TypeError."""
    pytest.importorskip("lightning")
    from flt_diag.integrations.lightning import FltDiagCallback

    torch.manual_seed(0)
    module = lightning_module(loops=2)
    recorded = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.125)
    callback = FltDiagCallback(blocks="net.layer", folder=tmp_path / "pl", steps=9, optimizer=recorded)
    lightning_fit(module, callback, steps=3, n_batches=3)
    assert load_config(tmp_path / "pl").train.steps == 9
    df = load_metrics(tmp_path / "pl")
    assert (df[df.metric == M.LR].value == 0.125).all() and len(df[df.metric == M.LR]) == 3


def hooks_on(model) -> int:
    """Every forward (pre-)hook on the model's modules and every post-accumulate hook on its parameters."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) + \
        sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def hf_trainer(model, callbacks, out, raise_in: str, at_step: int = 2, steps: int = 4):
    """transformers' Trainer on the CPU (as hf_fit) whose compute_loss or data collator raises at step `at_step`
    (RuntimeError "boom"): outside the model's forward."""
    import transformers

    class Trainer(transformers.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            if raise_in == "compute_loss" and self.state.global_step == at_step:
                raise RuntimeError("boom")
            return super().compute_loss(model, inputs, *args, **kwargs)

    batches_made = []

    def collate(features):
        batches_made.append(1)
        if raise_in == "collator" and len(batches_made) == at_step + 1:
            raise RuntimeError("boom")
        return transformers.default_data_collator(features)

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (4 * steps, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4,
                                          report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                                          logging_strategy="no", dataloader_num_workers=0)
    return Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=callbacks)


def StepsDone():
    """A TrainerCallback keeping the optimizer steps the Trainer finished (0, 1, ...)."""
    import transformers

    class Done(transformers.TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step - 1)
    return Done()


@pytest.mark.parametrize("raise_in", ["compute_loss", "collator"])
def test_hugging_face_exception_outside_the_forward_lets_go(tmp_path, raise_in):
    """An exception in compute_loss or the data collator (outside the model's forward; the Trainer tells its
    callbacks of none) leaves no hook on the model and the folder unlocked; the two steps before it stay."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from flt_diag.integrations.hf import FltDiagCallback
    from flt_diag.storage.folders import folder_lock

    torch.manual_seed(0)
    model = looped_gpt2(loops=2)
    before = hooks_on(model)
    callback, done = FltDiagCallback(blocks="gpt.transformer.h.*", folder=tmp_path / "hf"), StepsDone()
    with pytest.raises(RuntimeError, match="boom"):
        hf_trainer(model, [callback, done], tmp_path / "out", raise_in).train()
    assert hooks_on(model) == before == 0 and "forward" not in model.__dict__
    assert not (tmp_path / "hf" / ".lock").exists()
    with folder_lock(tmp_path / "hf"):  # (a second writer would be refused while the probe held it)
        pass
    assert done.steps and sorted(set(load_metrics(tmp_path / "hf").step)) == done.steps
    assert not (tmp_path / "hf" / "summary.json").exists()


def test_a_new_callback_lets_go_of_a_stale_probe(tmp_path, capfd):
    """A callback added after the Trainer was built (its train() not wrapped) is left watching by an exception in
    compute_loss; a new callback on the same model lets go of it (said once), and ends with no hook left."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from flt_diag.integrations.hf import FltDiagCallback
    from flt_diag.storage.folders import folder_lock

    torch.manual_seed(0)
    model = looped_gpt2(loops=2)
    old = FltDiagCallback(blocks="gpt.transformer.h.*", folder=tmp_path / "old")
    trainer = hf_trainer(model, [], tmp_path / "out", "compute_loss")
    trainer.add_callback(old)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    assert hooks_on(model) > 0  # (stale: nothing told the callback)
    capfd.readouterr()
    new = FltDiagCallback(blocks="gpt.transformer.h.*", folder=tmp_path / "new")
    hf_trainer(model, [new], tmp_path / "out2", "nowhere").train()
    err = capfd.readouterr().err
    assert err.count("still carried the hooks of the probe writing") == 1 and str(tmp_path / "old") in err
    assert hooks_on(model) == 0
    with folder_lock(tmp_path / "old"):
        pass
    assert sorted(set(load_metrics(tmp_path / "old").step)) == [0, 1]
    assert sorted(set(load_metrics(tmp_path / "new").step)) == [0, 1, 2, 3]
    assert new.summary is not None


def lightning_losses_module(loops: int, manual: bool = False, steps_per_batch: int = 1, every: int = 1):
    """A LightningModule of a UniversalTransformer (`net`) keeping each training_step's loss (`losses`). With
    `manual`, automatic_optimization = False and training_step steps the optimizer itself: `steps_per_batch`
    times a batch (a backward each), after every `every`-th batch's backward; it returns None."""
    import lightning as L

    from probe_models import UniversalTransformer, lm_loss

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.losses = UniversalTransformer(loops=loops), []
            self.automatic_optimization = not manual

        def forward(self, x):
            return self.net(x)

        def training_step(self, x, batch_idx):
            loss = lm_loss(self(x), x)
            self.losses.append(float(loss))
            if not manual:
                return loss
            opt = self.optimizers()
            for i in range(steps_per_batch):
                self.manual_backward(loss if i == 0 else lm_loss(self(x), x))
                if (batch_idx + 1) % every == 0:
                    opt.step()
                    opt.zero_grad()
            return None

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), 1e-3)
    return Module()


def test_lightning_gradient_accumulation(tmp_path):
    """accumulate_grad_batches=2: one step per two batches, its loss the mean of the two training_step losses
    (the module's own), the loops recorded at each step."""
    pytest.importorskip("lightning")
    from flt_diag.integrations.lightning import FltDiagCallback

    torch.manual_seed(0)
    module = lightning_losses_module(loops=3)
    callback = FltDiagCallback(blocks="net.layer", folder=tmp_path / "pl")
    lightning_fit(module, callback, steps=3, n_batches=6, accumulate_grad_batches=2)
    df = load_metrics(tmp_path / "pl")
    loss = df[df.metric == M.LOSS].sort_values("step")
    assert list(loss.step) == [0, 1, 2] and len(module.losses) == 6
    for step, value in zip(loss.step, loss.value):
        assert value == pytest.approx((module.losses[2 * step] + module.losses[2 * step + 1]) / 2, rel=1e-5)
    assert set(df[df.metric == M.RESID_NORM].loop) == {1, 2, 3}
    assert sorted(set(df[df.metric == M.LOOPS_RUN].step)) == [0, 1, 2]
    assert callback.summary is not None


@pytest.mark.parametrize("every", [1, 2])
def test_lightning_manual_optimization(tmp_path, every):
    """automatic_optimization = False: each optimizer step training_step takes is recorded, its loss the mean of
    those given to manual_backward since the last one (the module's own losses); every=2: its own accumulation."""
    pytest.importorskip("lightning")
    from flt_diag.integrations.lightning import FltDiagCallback

    torch.manual_seed(0)
    module = lightning_losses_module(loops=2, manual=True, every=every)
    callback = FltDiagCallback(blocks="net.layer", folder=tmp_path / "pl")
    lightning_fit(module, callback, steps=3, n_batches=3 * every)
    df = load_metrics(tmp_path / "pl")
    loss = df[df.metric == M.LOSS].sort_values("step")
    assert list(loss.step) == [0, 1, 2] and len(module.losses) == 3 * every
    for step, value in zip(loss.step, loss.value):
        assert value == pytest.approx(sum(module.losses[every * step:every * (step + 1)]) / every, rel=1e-5)
    assert set(df[df.metric == M.RESID_NORM].loop) == {1, 2}
    assert sorted(set(df[df.metric == M.GRAD_NORM].step)) == [0, 1, 2]
    assert callback.summary is not None


def test_lightning_two_manual_steps_a_batch_are_refused(tmp_path):
    pytest.importorskip("lightning")
    from flt_diag.integrations.lightning import FltDiagCallback

    torch.manual_seed(0)
    module = lightning_losses_module(loops=2, manual=True, steps_per_batch=2)
    callback = FltDiagCallback(blocks="net.layer", folder=tmp_path / "pl")
    with pytest.raises(Exception, match=r"^batch 0 took 2 optimizer steps \(automatic_optimization = False") as e:
        lightning_fit(module, callback, steps=4, n_batches=2)
    assert "\n" not in str(e.value)
    assert hooks_on(module) == 0 and not (tmp_path / "pl" / ".lock").exists()
