"""The startup heap set aside from the cyclic garbage collector (`gc.freeze`).

A full collection walks every object the collector tracks: ~150,000 once the API has imported its
modules (44 ms on the 2-core VM), more in a worker holding a model. The interpreter starts one
whenever enough objects have survived younger collections, in the middle of whatever runs then: in
the API it held every request of a burst at once (their intake moves in lockstep), and in a worker
it stalls the thread that feeds the engine. What a process makes while starting (modules, classes,
settings, tokenizers, pools, the engine) lives as long as the process; frozen, collections skip it.
Cycles made later are collected as before, and frozen objects are still freed when unreferenced.
"""

from __future__ import annotations

import gc


def freeze_startup() -> None:
    """Call once, when the process is about to serve: what exists now is never scanned again."""
    gc.collect()
    gc.freeze()
