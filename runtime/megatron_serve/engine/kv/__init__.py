"""The engine's KV cache as a wing: the paged pool and its allocator with the prefix cache (:mod:`.cache`), each
request's blocks as the scheduler takes, shares and publishes them (:mod:`.blocks`), the
host tier (:mod:`.offload`), the live requests' KV parked across a suspend (:mod:`.park`) and the blocks of
prefill/decode disaggregation (:mod:`.transfer`)."""
