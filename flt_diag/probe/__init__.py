"""The public probe (`flt_diag.watch`, docs/api.md): flt-diag's instruments on a looped model flt-diag did not
build, trained by any loop (watch.py; checks.py, model.py, folder.py; the loop dynamics:
flt_diag/instruments/dynamics_callback.py)."""
