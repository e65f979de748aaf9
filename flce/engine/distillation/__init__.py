"""Linear distillation on the shared engine: one more schedule (DistillChunks, :mod:`.schedule`) over the
engine's pieces (chunk bounds, WorkBuffer, GradAccumulator, the memory rule), its kernels' protocol and
call (:mod:`.call`), and the two autograd paths, eager (:mod:`.function`) and compiled (:mod:`.custom_ops`),
which :func:`.run.run_distillation` routes between."""
