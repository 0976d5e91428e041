"""A module the fork server tests run as a service: ``python -m tests.forked_child CODE|sleep``.
It prints what a service would see (argv, a variable of its environment, its folder, its
session and its parent), then exits with CODE, or sleeps until a signal ends it."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    print(json.dumps({"argv": sys.argv[1:], "marker": os.environ.get("FORKED_CHILD_MARKER"), "cwd": os.getcwd(),
                      "pid": os.getpid(), "sid": os.getsid(0), "main": __name__,
                      "preloaded": "xml.dom.minidom" in sys.modules}), flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(600)  # noqa: sleep - a service that runs until it is stopped
    sys.exit(int(sys.argv[1]))
