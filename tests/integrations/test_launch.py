"""``nereus launch`` end to end: a job started by the launcher on 3 processes, a fourth process
started by a second ``nereus launch --join`` against the job's store, and a rank killed by
SIGKILL later in the run. torchrun's agent would stop every worker at that death (and restart
them all from a checkpoint); this launcher only reports it, and the job goes on: the joiner gets
GPU 3 and state by a transition, the dead rank's ZeRO shard comes back from the last checkpoint,
the rest from the survivors' memory, and every process that is left finishes the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from nereus.runtime.launch import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
def test_nereus_launch_keeps_the_job_going_through_a_join_and_a_death(tmp_path):
    port = free_port()
    log, ckpt = tmp_path / "decisions.jsonl", tmp_path / "ckpt"
    args = ["--steps", "9", "--kill-step", "6", "--kill-rank", "1", "--leave-step", "-1", "--stay"]
    args += ["--tp", "1", "--dp", "3", "--gpus", "4", "--timeout", "30", "--pg-timeout", "10", "--quiet"]
    args += ["--checkpoint-every", "1", "--checkpoint-dir", str(ckpt)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    nereus = [sys.executable, "-m", "nereus", "launch"]
    # the joiner first: it waits for the job's store, then for the job to admit it at a step's end
    joiner = subprocess.Popen(
        [*nereus, "--join", f"127.0.0.1:{port}", "grpo_tiny.py", "--join", *args],
        cwd=EXAMPLES,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    job = subprocess.run(
        [*nereus, "--nproc", "3", "--master", f"127.0.0.1:{port}", "grpo_tiny.py", *args, "--decision-log", str(log)],
        cwd=EXAMPLES,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    joined_out, _ = joiner.communicate(timeout=60)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert joiner.returncode == 0, joined_out[-3000:]
    assert "rank 1 died (SIGKILL); the others go on" in job.stdout
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    applied = [d for d in lines if "applied" in d]
    made = [d for d in lines if "action" in d and d["action"] == "transition"]
    assert [d["applied"] for d in applied] == ["transition", "transition"], applied
    assert made[0]["triggers"][0]["kind"] == "gpus_joined" and made[0]["numbers"]["gpus_used"] == [0, 1, 2, 3]
    death = applied[1]["numbers"]
    assert applied[1]["step"] == 6 and death["failed_gpus"] == [1] and death["regroup_gpus"] == [0, 2, 3]
    assert death["restored"] > 0 and death["bytes_moved"] + death["restored"] == death["lower_bound"]
    assert max(d["step"] for d in lines if "action" in d) == 8  # the run went on to its last step
