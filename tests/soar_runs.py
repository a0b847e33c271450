"""Helpers of the end-to-end tests: soar.py and populora.py under torchrun with 2 ranks on the small
built-in world, reading what they wrote, and killing what they started."""
import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# g = 2, r = 2: four students over two groups of one rank; small everything else
FLAGS = ["--world", "small", "--outer_steps", "3", "--num_datasets", "2", "--students", "2",
         "--dataset_size", "4", "--qr_size", "8", "--window", "1", "--promote_every_step",
         "--inner_steps", "2", "--inner_step_inc", "1", "--student_questions", "2",
         "--student_samples", "4"]
LORA = ("--lora_rank", "8")   # the same run with LoRA adapters (conftest.lora_run)
TIMING = {"teacher_generation", "student_rollouts", "student_training", "evaluation",
          "teacher_update", "sync", "total"}


def soar(out, *extra, wait=True, **popen):
    """soar.py FLAGS extra on `out` (torchrun)"""
    return torchrun("soar.py", out, *FLAGS, *extra, wait=wait, **popen)


def torchrun(script, out, *args, wait=True, **popen):
    """the script with args on `out` under torchrun with 2 ranks: run to the end (a
    CompletedProcess), or started (a Popen whose pid is torchrun's, in a session of its own); popen:
    more subprocess arguments"""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, script), "--out", str(out), *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, **popen)
    popen.setdefault("timeout", 900)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **popen)


def rows(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def without_timing(metrics):
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("perf/")}
            for r in metrics]


def dcp_keys(path):
    from torch.distributed.checkpoint import FileSystemReader
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def descendants(pid) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in map(int, f.read().split()):
                    out += [child] + descendants(child)
    except FileNotFoundError:
        pass
    return out


def alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"   # a zombie has exited
    except FileNotFoundError:
        return False


def kill_all(p) -> None:
    """SIGKILL every process of a run started by soar(wait=False): torchrun and all it started"""
    for pid in descendants(p.pid)[::-1] + [p.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def wait_for(path, p, timeout=600, delay=0.0):
    """until `path` exists (then `delay` seconds more) while the run `p` is alive"""
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert p.poll() is None, \
            f"the run ended before {path} appeared:\n" + p.stdout.read()[-3000:]
        assert time.time() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.05)
    time.sleep(delay)


def wandb_records(folder) -> list[tuple[str, object]]:
    """(offline run folder, record) of every record W&B's offline runs wrote under folder/wandb"""
    return [(os.path.basename(os.path.dirname(p)), r)
            for p in sorted(glob.glob(os.path.join(folder, "wandb", "offline-run-*", "*.wandb")))
            for r in read_wandb_file(p)]


def read_wandb_file(path: str):
    """The protobuf Records of a W&B .wandb file (W&B 0.31 has no Python reader of its own): a
    LevelDB-style log, a 7-byte file header, then 32 KiB blocks of records, each behind a 7-byte
    header (CRC, length, type 1 full, 2 first, 3 middle, 4 last). The end a kill cut is left out."""
    from wandb.proto import wandb_internal_pb2 as pb
    with open(path, "rb") as f:
        b = f.read()
    pos = 7       # past the file header
    part = b""    # a record's pieces so far
    while pos + 7 <= len(b):
        _, n, kind = struct.unpack("<IHB", b[pos:pos + 7])
        if (left := 32768 - pos % 32768) < 7 or kind == 0 or pos + 7 + n > len(b):
            pos += left   # a block's padding, or the cut end
            continue
        part += b[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            (rec := pb.Record()).ParseFromString(part)
            yield rec
            part = b""


def wandb_history(folder) -> list[dict]:
    """every row W&B's offline runs under folder logged, in order: {key: value, "_step": step}; a
    logged table or image is flattened to its <key>/_type, <key>/path, ..."""
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for _, r in wandb_records(folder) if r.WhichOneof("record_type") == "history"]
    return [{k: v for k, v in r.items() if k not in ("_timestamp", "_runtime")} for r in rows]
