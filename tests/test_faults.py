"""Fault injection: what a cluster does to a two-day run, done to soar.py on the small built-in
world (torchrun, 2 ranks, real engines). Every interrupted run must end equal to the uninterrupted
reference (conftest.full_run): same metrics.jsonl (timings aside), pq.jsonl and questions.jsonl."""
import contextlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soar_runs import (FLAGS, ROOT, alive, descendants, kill_all, rows, soar,  # noqa: E402
                       wait_for, wandb_history, wandb_records, without_timing)


OURS = re.compile(r'File ".*/(soar|rloo|data|world|eval|launch)\.py"')   # a traceback line of ours


def same_as_reference(out, full_run):
    ref, _ = full_run
    assert without_timing(rows(out / "metrics.jsonl")) == \
        without_timing(rows(ref / "metrics.jsonl"))
    for name in ("pq.jsonl", "questions.jsonl"):
        assert rows(out / name) == rows(ref / name), name


WANDB = ("--wandb", "soar-tests", "--wandb_name", "killed")   # (offline: conftest)


def two_nodes(out, *extra):
    """soar.py on two launchers of one rank each: two simulated nodes (c10d rendezvous on
    localhost); their logs"""
    port = str(29500 + os.getpid() % 1000)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
              "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
              "two-nodes", os.path.join(ROOT, "soar.py"), "--out", str(out), *FLAGS, *extra]
    nodes = [subprocess.Popen(launch, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    logs = [n.communicate(timeout=900)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    return "".join(logs)


@pytest.fixture(scope="module")
def faulted(full_run, tmp_path_factory):
    """One run through what a cluster does to a two-day run, resumed after each fault:
    - a full disk: files capped at 1 MB (RLIMIT_FSIZE: no root needed), smaller than a teacher
      shard, so the first checkpoint cannot be written;
    - a second run started on the live folder, then kill -9 of the launcher alone, well into
      step 2 (students train);
    - SIGKILL of every process while step 2's checkpoint is written;
    - the rest of the run on two simulated nodes.
    The last two launches log to W&B (offline: conftest), which must not change a thing.
    Returns the folder and what each launch printed."""
    import resource
    out = tmp_path_factory.mktemp("faults") / "k"
    cap = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # noqa: E731
    logs = dict(full_disk=soar(out, preexec_fn=cap))
    a = soar(out, wait=False)
    lock = out / ".lock"   # (the full disk's run left its own: wait for a's rank 0 to hold it)
    while not (m := re.search(r"pid (\d+)", lock.read_text() if lock.exists() else "")) or \
            int(m.group(1)) not in descendants(a.pid):
        assert a.poll() is None, a.stdout.read()[-3000:]
        time.sleep(0.05)
    logs["holder"] = m.group(1)
    t0 = time.time()
    logs["second"] = soar(out)   # on the live folder
    logs["second_seconds"] = time.time() - t0
    wait_for(out / "ckpt" / "step-2", a, delay=1.0)
    procs = descendants(a.pid)
    os.kill(a.pid, 9)
    a.wait()
    deadline = time.time() + 30
    while any(map(alive, procs)) and time.time() < deadline:
        time.sleep(0.2)
    logs["procs"], logs["orphans"] = procs, [pid for pid in procs if alive(pid)]
    for pid in logs["orphans"]:   # (so that the next launch is not held up by them)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    logs["launcher_killed"] = a.stdout.read()
    assert not (out / "ckpt" / "step-3").exists(), "the run finished before the kill"
    p = soar(out, *WANDB, wait=False)
    wait_for(out / "ckpt" / "step-3.tmp", p)
    kill_all(p)
    logs["step-3.tmp"] = p.stdout.read()
    assert not (out / "ckpt" / "step-3").exists(), "the run finished before the kill"
    logs["two_nodes"] = two_nodes(out, *WANDB)
    return out, logs


def test_killed_runs_resume_to_the_same_result(faulted, full_run):
    out, logs = faulted
    assert all("resuming at step" in logs[k] for k in ("step-3.tmp", "two_nodes"))
    assert "SOAR: 2 ranks, 2 student groups of 1" in logs["two_nodes"]
    same_as_reference(out, full_run)
    assert sorted(os.listdir(out / "ckpt")) == ["step-2", "step-3"]     # no .tmp left behind
    assert os.path.islink(out / "teacher") and (out / "teacher" / "config.json").exists()


def test_damaged_checkpoint_falls_back_to_the_one_before(faulted, full_run):
    """4 KiB flipped in one teacher shard (its size unchanged: the CRC finds it), the other cut
    short: both are reported, step 3 is set aside, the run resumes from step 2"""
    out, _ = faulted
    flipped, cut = sorted((out / "ckpt" / "step-3" / "teacher").glob("*.distcp"))
    size = os.path.getsize(flipped)
    with open(flipped, "r+b") as f:
        f.seek(size // 2)
        block = f.read(4096)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))
    assert os.path.getsize(flipped) == size
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) // 2)
    cut_size = os.path.getsize(cut)
    p = soar(out, *WANDB)   # (step 2 again: W&B had it, so it is not logged twice)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"{flipped} has changed since it was written (CRC-32" in p.stderr
    assert f"{cut} is {cut_size} bytes" in p.stderr
    assert f"resuming from {out / 'ckpt' / 'step-2'}" in p.stderr
    assert "resuming at step 2" in p.stdout
    assert (out / "ckpt" / "step-3.damaged").is_dir()                  # kept aside, not used again
    same_as_reference(out, full_run)


def test_a_killed_run_is_one_wandb_run_with_each_step_once(faulted):
    """four processes (two killed, one resumed to the end on two nodes, one fallen back a step)
    made offline W&B runs of one id, each deleting those before it (launch.drop_older_offline_runs):
    one is left, and it holds each metrics.jsonl row once, at its step, with its keys and values,
    and the run's settings as config. (A killed run keeps what W&B had written, every 15 s:
    nothing, when its steps are quicker than that; the next process logs it again.)"""
    out, _ = faulted
    run_id = json.loads((out / "wandb.json").read_text())["id"]
    state = json.loads((out / "ckpt" / "step-3" / "state.json").read_text())
    assert state["wandb"] == run_id
    records = wandb_records(out)
    (folder,) = {d for d, _ in records}
    assert folder.endswith("-" + run_id)
    logged = wandb_history(out)
    assert [r["_step"] for r in logged] == [0, 1, 2]
    assert without_timing([{k: v for k, v in r.items() if k != "_step"} for r in logged]) == \
        without_timing(rows(out / "metrics.jsonl"))   # (the fallback ran step 2 again: timings)
    for _, r in records:
        if r.HasField("run"):
            assert {i.key: json.loads(i.value_json) for i in r.run.config.update
                    if not i.key.startswith("_")} == state["config"]


def test_rows_cut_short_or_garbled_come_back_from_the_checkpoint(full_run, tmp_path):
    """a kill in the middle of writing rows, or a garbage line, and one while writing the HF
    folders at the end (teacher/ still holds step 2; eval.py would refuse it meanwhile:
    launch.hf_behind): the resume of the finished run rewrites every file from what the checkpoint
    committed, and says so, and rewrites teacher/, running no step again. (A finished run whose
    files are sound has nothing to do: test_soar_e2e.test_finished_run_does_nothing.)"""
    import shutil
    ref, _ = full_run
    out = tmp_path / "c"
    shutil.copytree(ref, out, symlinks=True)
    lines = (out / "questions.jsonl").read_text().splitlines(keepends=True)
    (out / "questions.jsonl").write_text("".join(lines[:-5]) + lines[-5][:20])   # a cut line
    (out / "metrics.jsonl").write_text(
        "".join((ref / "metrics.jsonl").read_text().splitlines(keepends=True)[:-1]))
    with open(out / "pq.jsonl", "a") as f:
        f.write("\x00\x17 garbage {\n")
    tag = json.loads((out / "teacher" / "soar.json").read_text())
    (out / "teacher" / "soar.json").write_text(json.dumps({**tag, "step": 2}))
    p = soar(out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "nothing to do" not in p.stdout and not re.search(r"^step \d/3", p.stdout, re.M), \
        p.stdout   # teacher/ written again, no step run again
    for name in ("questions.jsonl", "metrics.jsonl", "pq.jsonl"):
        assert f"resume: {out / name} differed from what {out / 'ckpt' / 'step-3'} committed" \
            in p.stderr
    assert json.loads((out / "teacher" / "soar.json").read_text()) == tag
    same_as_reference(out, full_run)


def test_a_full_disk_ends_in_one_line_and_the_rerun_starts_over(faulted):
    """(faulted's first launch) one line names the checkpoint and the space; no .tmp stays; the
    next launch starts over in the same folder"""
    out, logs = faulted
    err = logs["full_disk"].stderr
    assert logs["full_disk"].returncode != 0
    line = f"soar.py: error: cannot write the checkpoint {out / 'ckpt' / 'step-1.tmp'} ("
    assert line in err and "B are free there" in err, err[-3000:]
    assert err.count("soar.py: error:") == 1 and not OURS.search(err)
    assert "starting at step 0" in logs["launcher_killed"]
    assert not (out / "ckpt" / "step-1.tmp").exists()


@pytest.mark.parametrize("flags,says", [
    (["--students", "0", "--qr_size", "100000", "--inner_steps", "0", "--window", "0"],
     ["--students 0: need r >= 1", "--qr_size 100000: each step samples M=100000",
      "--inner_steps 0: need at", "--window 0"]),
    (["--model", "/no/such/model"], ["--model /no/such/model: neither an HF model folder nor"]),
    (["--out", "/sys/soar"], ["/sys/soar: cannot write there"]),
])
def test_bad_input_ends_in_one_line(flags, says, tmp_path):
    out = tmp_path / "e"
    p = soar(out, *flags)
    assert p.returncode != 0
    assert p.stderr.count("soar.py: error:") == 1, p.stderr[-3000:]    # rank 0 alone says it
    assert all(s in p.stderr for s in says), p.stderr[-3000:]
    assert not OURS.search(p.stderr)                                   # no traceback of ours
    assert not out.exists()                                            # nothing left behind


def test_one_run_per_folder_and_ranks_die_with_their_launcher(faulted):
    """(faulted) a second run on the live folder is refused at once, naming the folder and the live
    process; after kill -9 of the launcher alone, its ranks (and what they started) exit within
    seconds; the next launch takes the dead run's lock"""
    out, logs = faulted
    b = logs["second"]
    assert b.returncode != 0 and logs["second_seconds"] < 120
    assert f"{out} is in use by a live run (pid {logs['holder']}" in b.stderr
    assert len(logs["procs"]) >= 2
    assert not logs["orphans"], "processes outlived their launcher by 30 s"


@pytest.mark.parametrize("flock", [True, False])
def test_lock_folder_refuses_a_second_holder_and_frees_with_the_first(flock, tmp_path):
    """the lock eval.py takes on each run folder (launch.lock_folder), outside any SOAR run; without
    flock (some NFS, FUSE mounts) a .lock.pid file, taken over once its holder is dead"""
    take = ("import sys, time, launch, rloo; rloo.init_distributed(); "
            "launch.lock_folder(sys.argv[1]); print('locked', flush=True); time.sleep(600)")
    if not flock:
        take = ("import errno, fcntl\ndef no(*a): raise OSError(errno.ENOLCK, 'No locks')\n"
                "fcntl.flock = no\n" + take)
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


FAILS_ON_RANK_1 = """
import os, sys
sys.path.insert(0, sys.argv[1])
import launch, rloo

def work():
    rloo.init_distributed()
    if os.environ["RANK"] == "1":
        raise RuntimeError("CUDA out of memory (raised on purpose by the test)")
    rloo.all_gather(0)   # rank 0 waits on rank 1, as in any collective

launch.main("fails.py", work)
"""


def test_an_error_on_one_rank_prints_its_traceback_there(tmp_path):
    """an error raised on rank 1 alone: rank 1 prints its full traceback, each line marked with its
    rank, and the run exits non-zero (an OOM on rank 17 must not look like a network fault on 0)"""
    script = tmp_path / "fails.py"
    script.write_text(FAILS_ON_RANK_1)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(script), ROOT], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "[rank 1] Traceback (most recent call last):" in p.stderr, p.stderr[-3000:]
    assert '[rank 1]   File "' + str(script) + '", line 9, in work' in p.stderr, p.stderr[-3000:]
    assert "[rank 1] RuntimeError: CUDA out of memory (raised on purpose" in p.stderr


def test_a_usage_error_through_run_sh_ends_with_its_line(tmp_path):
    """./run.sh with a setting that cannot work: soar.py's line is the last thing on stderr, no
    traceback of torchrun's after it, exit code 2"""
    # run.sh's environment: the one these tests run in where run.sh set it up (else a checkout
    # without .venv, such as a git worktree, would install one: minutes)
    ours = os.path.exists(os.path.join(sys.prefix, ".soar-installed"))
    p = subprocess.run(["bash", os.path.join(ROOT, "run.sh"), *FLAGS, "--outer_steps", "0",
                        "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, VENV=sys.prefix) if ours else None)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert lines[-2:] == ["soar.py: error: these settings cannot work:",
                          "  --outer_steps 0: need at least 1"], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "ChildFailedError" not in p.stderr
