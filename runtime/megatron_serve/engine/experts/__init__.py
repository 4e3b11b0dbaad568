"""Expert parallelism on the engine's side: which all-to-all moves tokens between the ranks' experts
(:mod:`.backend`, ``--all2all-backend``), EPLB's balancer that moves experts between ranks as their loads drift
(:mod:`.balancer`, ``--enable-eplb``), and where the experts of a rank that left go (:mod:`.recovery`). The layers
themselves (dispatchers, the MoE block, the plans) are the model's (``model/experts/``)."""
