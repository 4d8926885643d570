"""The figures of flt_diag.results.figures in display order: name -> (the module that draws it, its one-line
help). The one place each is written: known without importing matplotlib or pandas, so that `flt-diag plot
--help` lists them at once, and read by `register` (flt_diag.results.figures), which gives each figure of
the package its help and its place from here and refuses one drawn by another module."""

FIGURE_NAMES: dict[str, tuple[str, str]] = {
    "residuals": ("residuals", "final-loop residual norm over steps, a panel per loops K, a line per variant"),
    "depth": ("depth", "residual norm by loop index (and layer) at the first, middle and last step"),
    "gradients": ("gradients", "gradient-norm and cosine series per loops K, with the oscillation indices"),
    "loss": ("loss", "smoothed training loss (as the verdict sees it) per loops K, collapse marked"),
    "collapse": ("collapse", "variant x loops (x depth) grid coloured by verdict, annotated with the gap to the best "
                             "val loss"),
    "loops": ("loops", "validation loss (and task accuracy) against inference loops (after `flt-diag eval-loops`)"),
    "map": ("map", "stability map: where each variant's training breaks, per loops K (map folders only)"),
    "breaking": ("breaking", "each variant's breaking point with its seed spread, sorted, the paper's five in bold "
                             "(map folders only)"),
    "accuracy": ("accuracy", "held-out task accuracy against the training loops K, one line per variant"),
    "exit-loss": ("dynamics", "loss of the head at every loop's exit, at a few steps, a panel per loops K"),
    "loop-dynamics": ("dynamics", "fixed-point residual, contraction (spectral radius, perturbation growth) and token "
                                  "cosine by step and by loop"),
    "weights": ("weights", "parameter norms and update ratios per group kind against step"),
    "attention": ("weights", "attention entropy by (loop, layer) at the last recorded step, per run"),
}
