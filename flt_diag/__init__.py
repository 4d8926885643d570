"""flt-diag: diagnose looped-transformer training instability."""
