"""The instruments both flt-diag's Trainer and flt_diag.watch stand on, model-agnostic: the hooks and their
callback (diagnostics), the loop dynamics, the callback moments, the step record, the online early warning."""
