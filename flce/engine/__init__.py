"""The engine every backend shares: named schedules over its kernels, and the two autograd paths.

A backend's planner (``backends/<name>/plan.py``) answers one call with a :class:`~flce.engine.call.EngineCall`:
its kernels and one named plan (:mod:`flce.engine.plans`). Each plan is run by its own schedule module,
which reads top to bottom:

* :mod:`flce.engine.all_rows` -- statistics of all rows at once, nothing kept (inference; the first pass
  of the other schedules where they need every row's statistics before any gradient);
* :mod:`flce.engine.token_chunks` -- token chunks: gradients during forward, or a deferred backward that
  reuses the logits forward kept and recomputes the rest chunk by chunk;
* :mod:`flce.engine.vocab_blocks` -- vocabulary blocks of all rows: statistics first, then each block's
  logits recomputed and turned into its gradients (small memory budgets).

:mod:`flce.engine.schedule` picks the module by the plan's type. Kernels are a protocol of row kernels
that every backend implements plus optional capabilities (:mod:`flce.engine.kernels`); a plan states the
capabilities it needs and the engine refuses a plan whose backend lacks one. Eager calls run through the
``torch.autograd.Function`` of :mod:`flce.engine.function`, calls that ``torch.compile`` traces through the
custom ops of :mod:`flce.engine.custom_ops`; :func:`flce.engine.run.run_backend` routes between them.
"""
