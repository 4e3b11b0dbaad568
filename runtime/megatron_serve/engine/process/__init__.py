"""An engine process: one engine serving the coordinator (``megatron-serve engine``), as a small shell around it.

Two threads with one job each:

* :class:`~.link.CoordinatorLink` (background thread) owns the DEALER socket (HELLO, heartbeats, reconnects; see its
  module).
* :class:`~.loop.EngineProcess` (main thread) is a thin loop over the engine interface
  (:class:`~megatron_serve.engine.served.ServedEngine`): apply incoming messages at step boundaries, call
  ``engine.step()`` while RUNNING, report every step's outputs. Lifecycle verbs are applied between steps, so PAUSE
  always takes effect at a step boundary. The loop counts its iterations (it never blocks for more than 50 ms while
  idle) and the heartbeats report that count as ``progress``: since they come from the link thread, the count is how
  the coordinator tells a hung step loop from a live one.

The shell does no verb's work: it checks a verb against the lifecycle table and hands it to the engine
(``engine.call(step, body)``, :mod:`megatron_serve.engine.verbs.actions`), then acknowledges with what the engine answered;
so vLLM's ``EngineCoreProc`` (the loop, its sockets) stands apart from ``EngineCore``. One module per job of the
loop: :mod:`.loop` (the loop), :mod:`.inbox` (what the coordinator sent), :mod:`.registration` (a registration,
first or again), :mod:`.verb` (a verb's dispatch), :mod:`.drain` (draining and the hand-back), :mod:`.stats` (what
the next heartbeat says); beneath them all :mod:`.shell` (where the process stands with its coordinator, and the
acts the jobs share: send, acknowledge, a step and its report, the heartbeat's refresh), so that the loop imports
its jobs, the jobs import the shell, and nothing imports back.

SIGTERM: send DRAINING (the coordinator stops routing here), keep stepping until the work is done
or ``drain_timeout`` passes, hand the rest back (the coordinator re-queues it, continuing from the
tokens already streamed) and exit 0. STOP from the coordinator does the same and acknowledges.
"""
