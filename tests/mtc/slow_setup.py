"""`python -m tests.mtc.slow_setup WHERE MARKER mtc-arguments...`: `mtc` (run as ``python -m``, as
torchrun launches it) whose set-up waits at a known point until it is interrupted, for
tests/mtc/test_cli_signals.py. It creates ``MARKER`` when it starts waiting, so the test sends
SIGINT there and nowhere else.

``WHERE``: ``parser``, in `mtc.cli.build_parser` (which imports torch); ``exec``, in `open_run`,
inside code run by ``exec`` of a string, as a dataclass's generated methods are while a module is
imported lazily during set-up.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def _waiting(marker: str, real, in_exec: bool):  # noqa: ANN001, ANN202
    def wait(*a: object, **kw: object) -> object:
        Path(marker).touch()
        if in_exec:
            exec("while True:\n    time.sleep(0.01)", {"time": time})  # noqa: S102
        while True:
            time.sleep(0.01)

    return wait


def main() -> int:
    """Install the wait, run `mtc` with the remaining arguments, return its exit code."""
    import mtc.cli
    import mtc.train  # noqa: F401  (the package attribute is the API function: the module is in sys.modules)

    train = sys.modules["mtc.train"]
    where, marker, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    if where == "parser":
        mtc.cli.build_parser = _waiting(marker, mtc.cli.build_parser, False)
    else:
        train.open_run = _waiting(marker, train.open_run, True)
    return mtc.cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
