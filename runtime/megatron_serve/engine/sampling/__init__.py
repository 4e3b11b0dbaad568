"""Sampling on the engine's side: the per-slot sampling state the table's rows fill (:mod:`.sampling_state`), the
sampler that turns logits into tokens and log probabilities (:mod:`.sampler`), vLLM's logits processors
(:mod:`.logits_processors`), grammar-constrained decoding (:mod:`.structured_output`), the prompt's scores
(:mod:`.prompt_scores`) and the check that served log probabilities match a reference pass (:mod:`.logprob_parity`)."""
