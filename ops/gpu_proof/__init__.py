"""The GPU proof kit (issue 50): `bash ops/gpu_proof.sh bundle` here, `bash ops/gpu_proof.sh gpu` on a
machine with a CUDA GPU and no package registry. docs/gpu.md ("The proof kit") gives the calls.

    bundle.py  assembles KIT (wheels, the two libraries' source wheels, SmolLM2's tokenizer, the
               model config) and checks it and the working tree against the carry limit
    run.py     the GPU half: steps in order, each time-boxed, one report and one log in $OUT
    steps.py   what each step does (the GPU-only parts stubbed under SPOOL_GPU_PROOF_DRY=1)
    model.py   the random-weight FP16 Llama both libraries load

Stdlib only at import time: run.py starts on a bare Python before anything is installed.
"""

from __future__ import annotations

KIT = "gpu_kit"  # at the repository root, git-ignored, named in the device call's `carry`
LIMIT_BYTES = 64 * 1024 * 1024  # what travels: the working tree plus the carried paths
COMMAND_LIMIT = 2000  # characters of one device command
# The device call, as docs/gpu.md gives it (tests/unit/test_gpu_proof.py checks both).
DEVICE_COMMAND = "bash ops/gpu_proof.sh gpu"
CARRY = (KIT,)
BUDGET_S = 530.0  # the GPU half ends inside 9 minutes, its own start and the report included
