"""Mixture-of-experts: the layer (:mod:`.moe`), how tokens reach the ranks holding their experts (:mod:`.dispatch`,
:mod:`.token_dispatcher`, :mod:`.capacity_dispatcher`, :mod:`.deepep_dispatcher`), and expert load balancing with
the moves it plans (:mod:`.eplb`, :mod:`.eplb_recovery`, :mod:`.moves`)."""
