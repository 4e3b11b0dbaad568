"""An engine's rank group: one process per GPU, ranks in lockstep (tensor, pipeline and data-parallel attention).

Rank 0 of a group owns the scheduler and talks to the coordinator. Each step it writes the batch
into its step buffers and broadcasts their used part as one packed integer array (:class:`.channel.PlanChannel`:
a three-integer header, then the plan, over a gloo group; no pickled object per step); every rank
runs the forward pass on its weight slice and its share of the KV heads; rank 0 samples from the
gathered logits. With overlapped scheduling a step's gathered rows take the previous step's
sampled tokens, which rank 0 broadcasts on the device group first. Suspend, resume, refit and stop
go through the same channel, so a verb always acts on the whole group (a suspend that keeps the KV parks the same
blocks on every rank, each its own part of them, and rank 0's resume says whether to copy them back). With pipeline
stages (``--pipeline-parallel-size``) the group is ``stages x tensor_parallel_size`` ranks; the steps, the previous
tokens and the refit outcomes go over the whole group, each stage's layers use its own tensor-parallel group
(:func:`.placement.join_group`). With data-parallel attention (``--data-parallel-size``, :mod:`.data_parallel`) the
group is ``dp`` such groups, each led by an engine of its own (rank ``d * tp``), which broadcasts to its own ranks
only; the MoE layers' collectives span them all.

One module per job, as vLLM keeps its executor (which starts and drives the workers) apart from each worker's
process loop:

* :mod:`.placement`: where the ranks sit (the operator's rendezvous environment, or every rank on this machine),
  the rendezvous and the process groups it forms, and their release;
* :mod:`.channel`: rank 0's messages to the other ranks (:class:`~.channel.PlanChannel`);
* :mod:`.leader`: rank 0's runner, which broadcasts each step and lifecycle change before acting on it;
* :mod:`.follower`: every other rank's loop (load its slice, mirror rank 0's KV pool, follow the broadcasts, and
  its own part of suspend, resume and refit);
* :mod:`.spawn`: starting this machine's other ranks from rank 0's process, and leaving the group on a failed start;
* :mod:`.kv_tier` and :mod:`.kv_handoff`: every rank's part of the host KV tier's copies and of a prefilled
  request's blocks on their way to a decode engine, as rank 0 decides them;
* :mod:`.data_parallel` and :mod:`.turns`: what data-parallel attention ranks agree on at each turn;
* :mod:`.regroup` and :mod:`.survival`: the data-parallel ranks left after one is lost form a new group, agree where
  each stopped, and serve on.

If any rank dies, the next collective fails on the others, and they exit: the coordinator then sees the group gone
and re-queues its requests. Data-parallel attention ranks of one process each on CPU serve on instead
(:mod:`.survival`); the coordinator re-queues the lost rank's requests only.
"""
