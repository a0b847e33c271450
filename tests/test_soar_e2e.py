"""SOAR end to end on the small built-in world: torchrun with 2 ranks on CPU, real vLLM engines,
real FSDP2 (gloo), real math-verify. Then kill -9 and resume, and the clean failures."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# g = 2, r = 2: four students over two groups of one rank; small everything else
FLAGS = ["--world", "small", "--outer_steps", "3", "--num_datasets", "2", "--students", "2", "--dataset_size", "4",
         "--qr_size", "8", "--window", "1",
         "--tau", "-1", "--inner_steps", "2", "--inner_step_inc", "1", "--student_questions", "2",
         "--student_samples", "4"]
TIMING = {"teacher_generation", "student_rollouts", "student_training", "evaluation", "teacher_update", "sync",
          "total"}


def soar(out, *extra, wait=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "soar.py"), "--out", str(out), *FLAGS, *extra]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def rows(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def without_timing(metrics):
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("perf/")} for r in metrics]


def dcp_keys(path):
    from torch.distributed.checkpoint import FileSystemReader
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("soar") / "a"
    p = soar(out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p


def test_outputs_are_consistent(full_run):
    out, _ = full_run
    metrics = rows(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    promotions = 0
    for m in metrics:
        assert len(m["R"]) == 2 and all(len(row) == 2 for row in m["R"])
        assert m["R_k"] == pytest.approx([sum(row) / 2 for row in m["R"]])
        assert m["reward"] == pytest.approx(sum(m["R_k"]) / 2)
        assert all(-1 <= x <= 1 for row in m["R"] for x in row) and 0 <= m["acc0"] <= 1
        assert m["ma"] == pytest.approx(m["reward"])              # window 1
        # tau = -1 < any MA: every step promotes, argmax dataset, lower-middle student of r = 2
        assert m["promoted"] and m["promoted_k"] == max(range(2), key=lambda k: (m["R_k"][k], -k))
        row = m["R"][m["promoted_k"]]
        assert m["promoted_j"] == (0 if row[0] <= row[1] else 1)
        promotions += 1
        assert m["promotions"] == promotions
        assert m["inner_steps"] == 2 + min(promotions - 1, 2)     # S grows with earlier promotions
        assert 0 < m["teacher_valid_rate"] <= 1
        assert TIMING <= m.keys() and m["total"] >= m["student_training"] > 0
        # throughput: tokens per phase over all ranks, tokens/s per GPU (no MFU on CPU)
        for phase in ("teacher_generation", "student_rollouts", "evaluation"):
            assert m[f"tokens/generated/{phase}"] > 0 and m[f"perf/tokens_per_s_per_gpu/{phase}"] > 0
        assert m["tokens/trained/student_training"] > m["tokens/trained/teacher_update"] > 0
        assert not any(k.startswith("perf/mfu") for k in m)
        # two students per group, the last one stays in the model: one host snapshot per rank
        assert m["snapshots"] == 1
    pq = rows(out / "pq.jsonl")
    assert len(pq) == 4 * 3 and [r["step"] for r in pq] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(r["question"] and r["answer"] for r in pq)
    assert sorted(os.listdir(out / "ckpt")) == ["step-3"]
    state = json.loads((out / "ckpt" / "step-3" / "state.json").read_text())
    assert state["step"] == 3 and state["promotions"] == 3 and state["pq"] == 12
    # what a restart needs: the teacher with its AdamW state, the student's weights only
    teacher, student = dcp_keys(out / "ckpt" / "step-3" / "teacher"), dcp_keys(out / "ckpt" / "step-3" / "student")
    assert any(k.startswith("optim.") for k in teacher) and any(k.startswith("model.") for k in teacher)
    assert student and all(k.startswith("model.") for k in student)
    assert rows(out / "student" / "soar.jsonl") == [{"step": 3, "promotions": 3}]   # the HF folder's theta
    log = full_run[1].stdout
    assert "written per step: checkpoint" in log and "HF folders" in log
    assert re.search(r"step 3/3  reward [+-]\d\.\d{3}  MA [+-]\d\.\d{3}  promotions 3  valid \d+%  \d+ s", log)
    base = AutoModelForCausalLM.from_pretrained(state["config"]["model"]).state_dict()
    for name in ("teacher", "student"):   # HF folders that load, with the base model's tensors
        sd = AutoModelForCausalLM.from_pretrained(out / name).state_dict()
        assert sd.keys() == base.keys()
        if name == "teacher":  # it moved iff some step gave datasets different rewards (A_k != 0)
            moved = any(not (sd[k] == base[k]).all() for k in sd)
            assert moved == any(len(set(m["R_k"])) > 1 for m in metrics)


def test_finished_run_does_nothing(full_run):
    out, _ = full_run
    before = (out / "metrics.jsonl").read_text()
    p = soar(out)
    assert p.returncode == 0 and "nothing to do" in p.stdout
    assert (out / "metrics.jsonl").read_text() == before


def test_other_settings_refused(full_run):
    out, _ = full_run
    p = soar(out, "--dataset_size", "5")
    assert p.returncode != 0 and "other settings" in p.stdout + p.stderr and "'dataset_size': (4, 5)" in p.stdout + p.stderr


def test_kill_and_resume_gives_the_same_metrics(full_run, tmp_path):
    out_a, _ = full_run
    out = tmp_path / "b"
    p = soar(out, wait=False)
    deadline = time.time() + 600
    while not (out / "ckpt" / "step-1").exists():           # let step 0 commit, then kill mid step 1
        assert p.poll() is None and time.time() < deadline, p.stdout.read()[-3000:] if p.poll() is not None else ""
        time.sleep(0.5)
    time.sleep(2)
    # kill -9 every process of the run: torchrun puts its ranks in sessions of their own, so
    # killing torchrun's process group alone would leave them running
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(out).encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass
    p.wait()
    assert len(rows(out / "metrics.jsonl")) <= 2
    q = soar(out)
    assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
    assert "resuming at step" in q.stdout
    assert without_timing(rows(out / "metrics.jsonl")) == without_timing(rows(out_a / "metrics.jsonl"))
    assert rows(out / "pq.jsonl") == rows(out_a / "pq.jsonl")


def test_unchanged_student_scores_zero_and_snapshots_wait_for_a_full_window(tmp_path):
    """student lr 0: every trained student is the baseline, so R == 0 exactly (Acc0 is measured on the
    same engines and batches as the students), on a Q_R the model partly solves (easy sums). Window 2:
    step 0 cannot promote, so no snapshot is kept; step 1 can."""
    import random
    import world
    rng = random.Random(0)
    easy = tmp_path / "easy.jsonl"
    easy.write_text("".join(json.dumps({k: p[k] for k in ("question", "answer")}) + "\n"
                            for p in (world.make_problem(rng, 2) for _ in range(16))))
    out = tmp_path / "lr0"
    p = soar(out, "--student_lr", "0", "--window", "2", "--tau", "0.4", "--outer_steps", "2", "--train", str(easy))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = rows(out / "metrics.jsonl")
    assert all(m["acc0"] > 0 for m in metrics)
    assert [x for m in metrics for row in m["R"] for x in row] == [0.0] * 8
    assert [m["snapshots"] for m in metrics] == [0, 1] and not any(m["promoted"] for m in metrics)


def test_clean_failures(tmp_path):
    p = soar(tmp_path / "c", "--qr_size", "100000")
    assert p.returncode != 0 and "M=100000" in p.stdout + p.stderr
    p = soar(tmp_path / "d", "--teacher_max_tokens", "1", "--max_rejection_rounds", "2")
    assert p.returncode == 1 and "valid question-answer pairs" in p.stdout + p.stderr
