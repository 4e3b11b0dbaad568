"""What an engine prepares before it serves, so that nothing compiles mid-serving: the decode steps captured as CUDA
graphs (:mod:`.graphs`) and every kernel variant compiled by a warm-up pass (:mod:`.warmup`)."""
