"""The old path of flt_diag.integrations (kept for scripts that import it): hf.py and lightning.py re-export."""
