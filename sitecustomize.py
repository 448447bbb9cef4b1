"""Point the editable install of mtc at the worktree named by $MTC_ROOT (helpers' worktrees)."""
import os
import sys

_root = os.environ.get("MTC_ROOT")
if _root:
    mod = sys.modules.get("__editable___mtc_0_1_0_finder")
    if mod is not None:
        for k, sub in {"mtc": "mtc", "mtc.graphs": "graphs", "mtc.kernels": "kernels", "mtc.store": "store"}.items():
            mod.MAPPING[k] = os.path.join(_root, sub)
