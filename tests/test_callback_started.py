"""The Hugging Face and Lightning callbacks' moments take the probe their training made (integrations.watch.started):
a moment that comes before the training began is one ProbeError line, not an AttributeError on None."""
import pytest

from flt_diag.instruments.loop_hooks import ProbeError


@pytest.mark.parametrize("library, moment", [("lightning", "on_before_optimizer_step"),
                                             ("hf", "on_pre_optimizer_step")])
def test_a_moment_before_the_training_began_is_one_probe_error_line(library, moment):
    pytest.importorskip("lightning" if library == "lightning" else "transformers")
    module = __import__(f"flt_diag.integrations.{library}", fromlist=["FltDiagCallback"])
    callback = module.FltDiagCallback(folder="unused")
    with pytest.raises(ProbeError, match="^FltDiagCallback: a training moment came before the training began"):
        getattr(callback, moment)(None, None, None)  # (each library calls it with three arguments first)
