"""``megatron-serve rendezvous-store``: a store that a group's ranks reach as clients, served until SIGTERM, which
ends it with exit code 0; a port that is no port is refused, naming it, before the command imports torch."""

from __future__ import annotations

import datetime
import re
import signal
import subprocess
import sys

import torch.distributed as dist


def test_serves_a_store_until_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "megatron_serve.cli", "rendezvous-store", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the store serves (or the process ends: then it is empty)
        match = re.fullmatch(r"rendezvous store serving at 127\.0\.0\.1:(\d+)\n", line)
        assert match, line
        client = dist.TCPStore("127.0.0.1", int(match[1]), is_master=False, timeout=datetime.timedelta(seconds=30))
        client.set("ep/members", "x")
        again = dist.TCPStore("127.0.0.1", int(match[1]), is_master=False, timeout=datetime.timedelta(seconds=30))
        assert again.get("ep/members") == b"x"  # one store, whoever connects
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


#: The command's refusal in a fresh process, which then says whether it had imported torch.
REFUSAL = """
import sys
from megatron_serve import cli
try:
    cli.main(["rendezvous-store", "--port", "70000"])
except SystemExit as refused:
    print(refused, file=sys.stderr)
print("torch" in sys.modules, "megatron_serve.commands.rendezvous_store" in sys.modules)
"""


def test_a_port_out_of_range_is_refused_by_name_before_torch_is_imported():
    """Importing torch costs a process about 2 CPU-s; the refusal needs none of it."""
    done = subprocess.run([sys.executable, "-c", REFUSAL], capture_output=True, text=True, timeout=60)
    assert "--port 70000" in done.stderr, done.stderr
    assert done.stdout.split() == ["False", "True"], done.stdout  # the command ran, torch never came
