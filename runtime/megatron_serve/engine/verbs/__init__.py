"""The engine's side of the lifecycle verbs: the table of actions a verb runs (:mod:`.actions`), the steps that move
memory and weights (suspend, resume, refit: :mod:`.memory`) and the typed targets a refit loads into
(:mod:`.refit_targets`)."""
