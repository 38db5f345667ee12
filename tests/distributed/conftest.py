"""One spawned 2-process gloo run shared by every test of this folder (see ddp_workers.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from ddp_launch import run_distributed
from ddp_workers import all_checks

WORLD_SIZE = 2


@pytest.fixture(scope="session")
def ddp_results(tmp_path_factory) -> list[dict]:
    """``all_checks`` results, one dict per rank."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    out_dir = tmp_path_factory.mktemp("ddp")
    return run_distributed(all_checks, out_dir, str(out_dir), world_size=WORLD_SIZE)
