"""The field's loop stabilisers (issue 56), each one small named part of the looped model in a file of its own,
with its equation, its source and the choices flt-diag made where the source leaves a detail open (also in
docs/DESIGN.md §2b). Which variant uses which part is data: flt_diag.config.variants.VARIANTS.

  parcae.py          loop start A*x(t-1) + dt*B*norm(E) (a stable diagonal recurrence)
  huginn.py          loop start W [x(t-1); norm(E)]; Poisson-log-normal loop count per step
  stars.py           loss term |v^T J|^2 of one loop at the detached final state; log-normal loop count
  jacobian_fro.py    loss term: Hutchinson estimate of |J|_F^2 / n at the final state
  residual_scale.py  every residual branch times lambda / (K sqrt(L))
  deeploop.py        post-norm DeepNorm residual: alpha = (2N)^(1/2), init beta = (8N)^(-1/2), N = K L
  loop_embed.py      a learned, zero-initialised vector per loop index, added at the loop's start
  penalty.py         what the two loss terms share: one loop's map and its vector-Jacobian products
"""
