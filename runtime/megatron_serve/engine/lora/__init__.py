"""The engine's LoRA adapters as a wing: the names served and their slots (:mod:`.adapters`), the requests
waiting for a slot (:mod:`.queue`), pushed versions kept on disk (:mod:`.store`), the adapter verbs (:mod:`.verbs`)
and the decode graphs with adapter rows (:mod:`.graphs`)."""
