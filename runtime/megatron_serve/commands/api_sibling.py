"""One sibling API server of ``--api-server-count`` (:mod:`.api_servers`): ``python -m
megatron_serve.commands.api_sibling SPEC``, started by the first API server process only.

It runs the ``server`` command's serving path on the listening socket it inherited, with the
options the parent parsed (read from ``SPEC``, a file private to the user), quietly: the parent
announces the endpoint, once each sibling has written its ``INDEX`` on the pipe the spec names.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import sys

from ..processes.lifeline import hold_lifeline
from . import server
from .options import read_token, setup_logging


def main(spec_path: str, index: int) -> int:
    hold_lifeline()  # dies with the parent, whatever ends it
    with open(spec_path, "rb") as fh:
        spec = pickle.load(fh)
    args: argparse.Namespace = spec["args"]
    setup_logging(args.log_level)
    args.coordinator = spec["coordinator"]
    args.disable_log_stats = True  # the fleet's stats line comes from the first process only

    def serving(_url: str) -> None:
        os.write(spec["ready_fd"], f"{index}\n".encode())

    return server.serve_on(args, socket.socket(fileno=spec["fd"]), read_token(args), announce=False,
                           on_started=serving)  # no probe port


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
