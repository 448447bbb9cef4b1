"""One rank of `mtc train` for tests/mtc/test_dp_eval.py, with a spy on the validation forward.

Run as ``python tests/mtc/dp_eval_rank.py LOG mtc-arguments...`` under torchrun's environment.
Every `--eval-every` validation is recorded as ``[step, batches this rank ran forward, val_loss,
the loss of every eval batch on this rank alone]`` (the last is `forward_loss` over all of the
run's eval batches with the same weights: the single-process figure) and written to
``LOG.rank-R.json`` when the process ends.
"""

from __future__ import annotations

import atexit
import json
import os
import sys


def main() -> int:
    """Install the spy, run `mtc` with the remaining arguments, return its exit code."""
    from mtc import watch
    from mtc.cli import main as mtc_main
    from mtc.weight_sources import TierWeights

    log, argv = sys.argv[1], sys.argv[2:]
    evals: list[list[object]] = []
    ran = [0]
    forward = watch.forward_loss
    validate = watch.RunWatcher.validate

    def counting(fn):  # noqa: ANN001, ANN202
        def wrapped(program, runners, weights, batches, device, *a, **kw):  # noqa: ANN001, ANN202
            ran[0] += len(batches)
            return fn(program, runners, weights, batches, device, *a, **kw)

        return wrapped

    def spied_validate(self: watch.RunWatcher) -> float:
        ran[0] = 0
        loss = validate(self)
        alone = forward(self.program, self.runners, TierWeights(self.program, self.tiers, self.device), self._val,
                        self.device)
        evals.append([len(evals), ran[0], loss, alone])
        return loss

    for name in ("forward_loss", "batch_losses"):  # whichever the watcher runs its batches through
        if hasattr(watch, name):
            setattr(watch, name, counting(getattr(watch, name)))
    watch.RunWatcher.validate = spied_validate
    rank = os.environ.get("RANK", "0")

    def dump() -> None:
        with open(f"{log}.rank-{rank}.json", "w") as f:
            json.dump(evals, f)

    atexit.register(dump)
    return mtc_main(argv)


if __name__ == "__main__":
    sys.exit(main())
