"""Tensor parallelism of the indexer target: two gloo ranks, half of the heads each."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_all_reduced_head_shards_give_the_full_target(tmp_path):
    worker = Path(__file__).with_name("tp_worker.py")
    store = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), "2", str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        # Only the order of the fp32 head sums differs between the sharded and the full run.
        assert r["rd_target"] <= 1e-12, r
        assert r["rd_loss"] <= 1e-12, r
        assert r["target_sum"] > 0, r
