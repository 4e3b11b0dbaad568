"""LoRA in the model: PEFT checkpoints read and checked (:mod:`.checkpoint`), the slot table applied to a step's
rows (:mod:`.slots`), a rank's share of an adapter (:mod:`.shards`) and adapters on MoE experts (:mod:`.experts`)."""
