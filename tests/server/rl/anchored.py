"""``python anchored.py ANCHORS SCRIPT ARGV...``: ``SCRIPT`` as ``__main__`` with the folder ``ANCHORS`` on
``sys.path`` right after the script's own folder, where ``PYTHONPATH=ANCHORS python SCRIPT ARGV...`` puts it.

For a framework's runner forked from the test worker's fork server (:func:`tests.forked.run_scripts`): that
server read its ``PYTHONPATH`` when it started, so a ``PYTHONPATH`` given to the child reaches only what the child
starts; this puts the framework installed beside the venv (``.anchors``, ``.anchors-trl110``) before the venv's own
packages in the child itself. None of the fork server's preloaded modules is a package of those folders."""

from __future__ import annotations

import runpy
import sys

if __name__ == "__main__":
    anchors, script, *argv = sys.argv[1:]
    sys.path.insert(1, anchors)  # after the script's folder (sys.path[0], where the fork put this one's: the same)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
