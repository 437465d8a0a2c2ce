"""How the HF Trainer / Accelerate test ranks end: destroy the process group, then skip teardown.

A rank whose training had finished, every record written and its client closed, still died
with SIGABRT ("terminate called without an active exception") in interpreter teardown: once in
test_adapters_hf (2026-11-25, before destroy_process_group was called) and once in
test_user_job (2026-11-26, with it; 0 of 31 reruns by hand). The Trainer and Accelerate keep
references to the gloo process group past destroy_process_group, so its C++ threads are torn
down during interpreter finalization (pytorch/pytorch#190489 shows the same abort). Nothing of
odbd runs by then; os._exit after flushing ends the rank with the status it earned.
"""

from __future__ import annotations

import os
import sys

import torch


def end_rank(status: int = 0) -> None:
    """Destroys the process group (if any), flushes stdout/stderr and exits with `status`."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
