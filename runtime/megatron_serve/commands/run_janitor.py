"""``run``'s janitor: removes the run's directories once ``run`` has exited, however it exits.

``run`` removes its run directory (which holds the fleet secret) and the fleet's temporary log
directory when it stops; killed with ``kill -9`` it can do neither, and both stayed on disk, the
secret with them, until the user's next ``run`` (the children, which die with ``run``, are killed
by the kernel and cannot clean up either). So ``run`` starts this small process (a bare
interpreter, 13 MB resident) holding the read end of a pipe whose write end only ``run`` holds: the
kernel closes that end when ``run`` exits, and end-of-file tells the janitor to remove the
directories it was given and exit. A directory made later (the API servers' of ``--api-server-count``)
is given through the pipe itself, one path a line. It runs in a session of its own and ignores SIGINT and SIGHUP,
so that Ctrl-C or a closed terminal, which end ``run``, do not end it first. Only what kills the
janitor too (``kill -9`` of it, the OOM killer) leaves the directories, for the next ``run`` to remove.

Usage (by ``run`` only): ``python -m megatron_serve.commands.run_janitor FD DIR...``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


class Janitor:
    """The caller's end: the janitor process and the pipe's write end, kept open for as long as the caller lives
    (written only by :meth:`add`); its exit closes it."""

    def __init__(self, directories: list[Path]) -> None:
        read, self._write = os.pipe()  # neither end is inherited by anything else this process starts
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(read), *map(str, directories)],
                                        pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(read)

    def add(self, directory: Path) -> None:
        """Remove ``directory`` too once the caller has exited (unless the janitor was killed: then the caller's own
        stop is all that removes it)."""
        try:
            os.write(self._write, f"{directory}\n".encode())
        except BrokenPipeError:
            pass


def read_to_end(fd: int) -> bytes:
    """Everything written to the pipe's read end ``fd`` until end-of-file: the caller has exited."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def main(argv: list[str]) -> int:
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    fd, directories = int(argv[0]), argv[1:]
    directories += read_to_end(fd).decode().splitlines()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
