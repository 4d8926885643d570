"""`loops` is checked where it is declared (ModelConfig's field, when the config is built) and once more at most
(the command line's check of the flag, which names it): settling a config does not validate it again (issue 65)."""
import pytest

from flt_diag.config import run_config as R
from flt_diag.config.option_fields import ConfigError
from flt_diag.training.settle import run_config


def test_settling_a_config_builds_its_model_section_once(monkeypatch):
    built = []
    real = R.ModelConfig.__init__

    def counting(self, **values):
        built.append(values.get("loops"))
        real(self, **values)

    monkeypatch.setattr(R.ModelConfig, "__init__", counting)
    cfg = run_config(dict(preset="tiny", loops=3, steps=2, device="cpu"))
    assert cfg.model.loops == 3 and cfg.train.device == "cpu" and cfg.model.vocab_size % 64 == 0
    assert built == [3]  # built (and validated) once; settling copies it with the vocabulary filled in


def test_a_bad_loop_count_is_still_one_line_naming_the_flag():
    with pytest.raises(ConfigError, match=r"^--loops must be in 1\.\.1024, got 0$"):
        run_config(dict(preset="tiny", loops=0, device="cpu"))
