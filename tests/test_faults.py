"""Fault injection: what a cluster does to a two-day run, done to soar.py on the small built-in
world (torchrun, 2 ranks, real engines). Every interrupted run must end equal to the uninterrupted
reference (conftest.full_run): same metrics.jsonl (timings aside), pq.jsonl and questions.jsonl."""
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soar_runs import ROOT, alive, descendants, kill_all, rows, soar, wait_for, without_timing  # noqa: E402


def same_as_reference(out, full_run):
    ref, _ = full_run
    assert without_timing(rows(out / "metrics.jsonl")) == \
        without_timing(rows(ref / "metrics.jsonl"))
    for name in ("pq.jsonl", "questions.jsonl"):
        assert rows(out / name) == rows(ref / name), name


@pytest.fixture(scope="module")
def killed_three_times(full_run, tmp_path_factory):
    """SIGKILL every process of the run at three moments, resuming after each: early in step 1 (the
    teacher samples), well into step 2 (students train), and while step 2's checkpoint is written"""
    out = tmp_path_factory.mktemp("faults") / "k"
    logs = []
    for moment, delay in ((out / "ckpt" / "step-1", 0.3), (out / "ckpt" / "step-2", 1.0),
                          (out / "ckpt" / "step-3.tmp", 0.0)):
        p = soar(out, wait=False)
        wait_for(moment, p, delay=delay)
        kill_all(p)
        logs.append(p.stdout.read())
        assert not (out / "ckpt" / "step-3").exists(), "the run finished before the kill"
    q = soar(out)
    assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
    return out, logs + [q.stdout]


def test_killed_runs_resume_to_the_same_result(killed_three_times, full_run):
    out, logs = killed_three_times
    assert all("resuming at step" in log for log in logs[1:])
    same_as_reference(out, full_run)
    assert sorted(os.listdir(out / "ckpt")) == ["step-2", "step-3"]     # no .tmp left behind
    assert os.path.islink(out / "teacher") and (out / "teacher" / "config.json").exists()


def test_damaged_checkpoint_falls_back_to_the_one_before(killed_three_times, full_run):
    out, _ = killed_three_times
    shard = max((out / "ckpt" / "step-3" / "teacher").glob("*.distcp"), key=os.path.getsize)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    p = soar(out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert str(shard) in p.stderr and f"resuming from {out / 'ckpt' / 'step-2'}" in p.stderr
    assert "resuming at step 2" in p.stdout
    assert (out / "ckpt" / "step-3.damaged").is_dir()                  # kept aside, not used again
    same_as_reference(out, full_run)


def test_rows_cut_short_come_back_from_the_checkpoint(full_run, tmp_path):
    """a kill in the middle of appending the last step's rows: the resume (here of a finished run,
    which then has nothing to do) rewrites them from what the checkpoint committed"""
    import shutil
    ref, _ = full_run
    out = tmp_path / "c"
    shutil.copytree(ref, out, symlinks=True)
    lines = (out / "questions.jsonl").read_text().splitlines(keepends=True)
    # the last step's append cut after 3 of 8 rows
    (out / "questions.jsonl").write_text("".join(lines[:-5]))
    (out / "metrics.jsonl").write_text(
        "".join((ref / "metrics.jsonl").read_text().splitlines(keepends=True)[:-1]))
    p = soar(out)
    assert p.returncode == 0 and "nothing to do" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    same_as_reference(out, full_run)


def test_one_run_per_folder_and_ranks_die_with_their_launcher(full_run, tmp_path):
    out = tmp_path / "l"
    a = soar(out, wait=False)
    wait_for(out / ".lock", a)
    while "pid" not in (out / ".lock").read_text():
        time.sleep(0.05)
    holder = re.search(r"pid (\d+)", (out / ".lock").read_text()).group(1)
    # a second run on the live folder is refused at once, naming the folder and the live process
    t0 = time.time()
    b = soar(out)
    assert b.returncode != 0 and time.time() - t0 < 120
    assert f"{out} is in use by a live run (pid {holder}" in b.stderr
    # kill -9 of the launcher alone: its ranks (and what they started) exit within seconds
    wait_for(out / "ckpt" / "step-1", a)
    procs = descendants(a.pid)
    assert len(procs) >= 2
    os.kill(a.pid, 9)
    a.wait()
    deadline = time.time() + 30
    while any(map(alive, procs)) and time.time() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in procs if alive(pid)], "processes outlived their launcher by 30 s"
    # the dead run's lock does not block its resume
    c = soar(out)
    assert c.returncode == 0 and "resuming at step" in c.stdout, c.stdout[-3000:] + c.stderr[-3000:]
    same_as_reference(out, full_run)


def test_lock_folder_refuses_a_second_holder_and_frees_with_the_first(tmp_path):
    """the lock eval.py takes on each run folder (rloo.lock_folder), outside any SOAR run"""
    take = ("import sys, time, rloo; rloo.init_distributed(); rloo.lock_folder(sys.argv[1]); "
            "print('locked', flush=True); time.sleep(600)")
    env = dict(os.environ, PYTHONPATH=ROOT)
    first = subprocess.Popen([sys.executable, "-c", take, str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, text=True)
    assert first.stdout.readline().strip() == "locked"
    second = subprocess.run([sys.executable, "-c", take, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode != 0 and \
        f"{tmp_path} is in use by a live run (pid {first.pid}" in second.stderr
    first.kill()
    first.wait()
    third = subprocess.Popen([sys.executable, "-c", take, str(tmp_path)], env=env,
                             stdout=subprocess.PIPE, text=True)
    assert third.stdout.readline().strip() == "locked"
    third.kill()
    third.wait()
