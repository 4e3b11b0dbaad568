"""Imported at the start of a process whose ``PYTHONPATH`` begins here (``test_data_parallel_attention``: one engine
of two data-parallel attention ranks): its copy of a trainer's refit reaches the engine's step loop ``LATE_REFIT_S``
seconds after the coordinator sent it, many turns after the other engine's copy, as copies that travel on their own
links can arrive under load."""

import os
import queue
import time

# taken from the environment: the processes this one starts (its ranks' fork server, multiprocessing's resource
# tracker) hold no coordinator link, and would import the engine's modules here for nothing (seconds of CPU each)
LATE_REFIT_S = float(os.environ.pop("LATE_REFIT_S", "0"))

if LATE_REFIT_S:
    from megatron_serve.engine.process import link

    class _LateRefits(queue.Queue):
        def put(self, item, block=True, timeout=None):
            body = item[2] if item[0] == "message" else None
            if getattr(body, "rendezvous", None) is not None and (getattr(body, "phase", None) or "load") == "load":
                time.sleep(LATE_REFIT_S)  # on the link's thread: the loop goes on turning
            super().put(item, block, timeout)

    _init = link.CoordinatorLink.__init__

    def _late_inbox(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.inbox = _LateRefits()

    link.CoordinatorLink.__init__ = _late_inbox
