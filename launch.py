"""What a launched script needs around the method (soar.py, eval.py): its flags, its exit, one run
per folder, sharded checkpoints that a resume checks and falls back from, the rows files rewritten
from them, seeds, the step's counts, and W&B. The RL engine itself is rloo.py; the text side is
data.py.
"""
import argparse
import atexit
import dataclasses
import fcntl
import glob
import json
import os
import random
import re
import secrets
import shutil
import socket
import struct
import sys
import time
import traceback
import zlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import data
import rloo

# -----------------------------------------------------------------------------
KEEP_CKPTS = 2              # checkpoints kept: a damaged newest one falls back to the one before
# dense bf16 peak of one GPU, for the MFU estimate in metrics.jsonl (spec sheets, SXM parts)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}
USAGE_EXIT = 2              # a usage error's exit code (argparse's too); run.sh knows it
# -----------------------------------------------------------------------------


# -----------------------------------------------------------------------------
# errors and the exit

class UsageError(Exception):
    """What the user can fix, said in one line that names the flag, path or value at fault: a bad
    setting, a file that is not there, a folder in use, a disk too full for the checkpoint."""


def main(script: str, fn, *args) -> None:
    """Run fn(*args) as the script's main, then exit. A UsageError prints one line on rank 0 and
    exits USAGE_EXIT. Any other error prints its full traceback on every rank where it happened,
    each line behind "[rank N]", and exits 1 (an error rank 0 decided for all, on_rank0's, is
    printed by rank 0 alone). The engines and the process group are shut down on every path."""
    code = 0
    try:
        fn(*args)
    except UsageError as e:
        rloo.print0(f"{script}: error: {e}", file=sys.stderr)
        code = USAGE_EXIT
    except Exception as e:
        if rloo.rank0() or not getattr(e, "from_rank0", False):
            rank = os.environ.get("RANK", "0")
            text = "".join(traceback.format_exception(e))
            print("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()),
                  end="", file=sys.stderr, flush=True)
            if isinstance(e, RuntimeError) and "timed out" in str(e).lower():
                print(f"[rank {rank}] {script}: a collective (named above) waited longer than "
                      f"rloo.COLLECTIVE_TIMEOUT_MIN = {rloo.COLLECTIVE_TIMEOUT_MIN:g} minutes for "
                      "another rank: one hung or died, or ranks work apart longer than that",
                      file=sys.stderr, flush=True)
        code = 1
    finally:
        rloo.shutdown()
    sys.exit(code)


# -----------------------------------------------------------------------------
# flags: one dataclass field each, its help and least value in the field's metadata

def flag(default, help: str, least=None, choices=None, world=None):
    """a Config field: its default (the paper's), its --help line, the values it takes (at least
    `least`, too_small says which flags are below, all at once; or one of `choices`, argparse) and
    `world`, its value on the built-in world (used without --model; None: the default there too)"""
    return dataclasses.field(default=default, metadata={"help": help, "least": least,
                                                        "choices": choices, "world": world})


def world_values(cls) -> dict:
    """{flag: its built-in world value} of the fields of dataclass `cls` that have one"""
    return {f.name: f.metadata["world"] for f in dataclasses.fields(cls)
            if f.metadata.get("world") is not None}


def config_parser(cls, **kwargs) -> argparse.ArgumentParser:
    """A parser with a --flag per field of dataclass `cls`; help: the field's own, its default and,
    if any, its built-in world value (used without --model)."""
    p = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    world = world_values(cls)
    for f in dataclasses.fields(cls):
        h = f"{f.metadata.get('help', '')} (default {f.default!r}"
        if f.name in world:
            h += f"; built-in world {world[f.name]!r}"
        h = (h + ")").replace("%", "%%")
        if f.type is bool:
            p.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=None,
                           help=h)
        else:
            p.add_argument(f"--{f.name}", type=f.type, default=None, help=h,
                           choices=f.metadata.get("choices"), metavar=f.type.__name__.upper())
    return p


def config_from(cls, args: dict):
    """An instance of `cls`: the flags given, else (without --model: the built-in world) the
    fields' world values, else their defaults (with --model: the paper's settings). Without --model,
    rank 0 prints every world value used in place of the paper's."""
    names = {f.name for f in dataclasses.fields(cls)}
    flags = {k: v for k, v in args.items() if k in names and v is not None}
    world = {} if flags.get("model") else world_values(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    replaced = [f"{k} {v!r} (paper {defaults[k]!r})" for k, v in world.items()
                if k not in flags and v != defaults[k]]
    if replaced:
        rloo.print0("built-in world settings: " + ", ".join(replaced), file=sys.stderr)
    return cls(**{**world, **flags})


def too_small(cfg) -> list[str]:
    """each flag of cfg below its field's least value, as a line naming it"""
    return [f"--{f.name} {getattr(cfg, f.name)}: need at least {f.metadata['least']}"
            for f in dataclasses.fields(cfg)
            if f.metadata.get("least") is not None and getattr(cfg, f.name) < f.metadata["least"]]


def tokenizer(model: str):
    """the tokenizer of --model; a usage error if neither an HF folder nor a reachable hub id"""
    from transformers import AutoTokenizer   # (transformers is imported by rloo already)
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {model}: neither an HF model folder nor a hub id this machine "
                         f"can reach ({data.first_line(e)})") from None


def problems(path: str) -> list[dict]:
    """data.load_problems on rank 0 (it drops what times out), the same list on every rank; a file
    that is missing or malformed is a usage error naming it"""
    def load():
        try:
            return data.load_problems(path)
        except (ValueError, OSError, RuntimeError) as e:
            raise UsageError(str(e)) from None
    return rloo.on_rank0(load)


# -----------------------------------------------------------------------------
# one run per folder

_LOCKS = []   # lock files this process holds (lock_folder); the kernel releases them when it dies


def lock_folder(folder: str) -> None:
    """One run per folder: rank 0 locks folder/.lock for the process's life (flock; on a filesystem
    without it, a file .lock.pid made with O_EXCL). A second run on the folder stops at once with an
    error naming the folder and the live process; a dead run's lock never blocks its resume (flock
    goes with its process; a .lock.pid naming a dead pid of this host is taken over). All call."""
    rloo.on_rank0(_lock, folder)


def _lock(folder: str) -> None:
    me = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    busy = f"{folder} is in use by a live run ({{}}); wait for it to end, stop it, or choose " \
           "another folder"
    try:
        os.makedirs(folder, exist_ok=True)
        f = open(os.path.join(folder, ".lock"), "a+")
    except OSError as e:
        raise UsageError(f"{folder}: cannot write there ({e.strerror})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise UsageError(busy.format(f.read().strip() or "another process")) from None
    except OSError:   # no flock here (some NFS and FUSE mounts)
        f.close()
        path = os.path.join(folder, ".lock.pid")
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                with open(path) as g:
                    holder = g.read().strip()
                m = re.match(r"pid (\d+) on (\S+)", holder)
                if not (m and m[2] == socket.gethostname() and not _alive(int(m[1]))):
                    raise UsageError(busy.format(holder) + f" (if none is, remove {path})")
                os.remove(path)   # its run died
        os.write(fd, (me + "\n").encode())
        os.close(fd)
        atexit.register(lambda: os.path.exists(path) and os.remove(path))
        return
    f.truncate(0)
    f.write(me + "\n")
    f.flush()
    _LOCKS.append(f)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# -----------------------------------------------------------------------------
# checkpoints: out/ckpt/step-N holds all a restart needs: rloo.save_state per policy, the run's
# jsonl rows up to step N (rows/), and state.json, which lists every file's size and CRC-32
# (resume checks them); it is made as step-N.tmp and appears in one rename

def ckpt_dirs(out: str) -> list[str]:
    """the finished checkpoints, oldest first (not step-N.tmp, being written, nor step-N.damaged)"""
    root = os.path.join(out, "ckpt")
    done = ([d for d in os.listdir(root) if re.fullmatch(r"step-\d+", d)]
            if os.path.isdir(root) else [])
    return [os.path.join(root, d) for d in sorted(done, key=lambda d: int(d[5:]))]


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def _checked(folder: str, files: dict) -> list:
    """every rank reads its share of folder's `files` (relative path: [size, crc] or None to
    compute): the (path, size, crc) of each file of the share, or what is wrong with it"""
    mine = []
    for rel, want in sorted(files.items())[dist.get_rank()::dist.get_world_size()]:
        path = os.path.join(folder, rel)
        size = os.path.getsize(path) if os.path.exists(path) else None
        crc = _crc(path) if size is not None and (not want or size == want[0]) else None
        if size is None or want and size != want[0]:
            mine.append(f"{path} is {'missing' if size is None else f'{size} bytes'}"
                        + (f", {want[0]} bytes were written" if want else ""))
        elif want and want[1] is not None and crc != want[1]:
            mine.append(f"{path} has changed since it was written (CRC-32 {crc:08x}, written "
                        f"{want[1]:08x})")
        else:
            mine.append((rel, size, crc))
    return mine


def _begin(tmp: str, prev: str | None, linked: list, rows: dict) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "rows"))
    for name in linked:
        shutil.copytree(os.path.join(prev, name), os.path.join(tmp, name), copy_function=os.link)
    for name, new in rows.items():   # the previous checkpoint's rows and the new ones
        old = os.path.join(prev or "", "rows", name)
        text = open(old, encoding="utf-8").read() if prev and os.path.exists(old) else ""
        data.write_text(os.path.join(tmp, "rows", name), text + "".join(
            json.dumps(r, ensure_ascii=False) + "\n" for r in new))


def _finish(out: str, tmp: str, final: str, state: dict, files: dict) -> None:
    data.write_json(os.path.join(tmp, "state.json"), {**state, "files": files})
    os.rename(tmp, final)
    for old in ckpt_dirs(out)[:-KEEP_CKPTS]:
        shutil.rmtree(old)
    restore_rows(out, final, os.listdir(os.path.join(final, "rows")), quiet=True)


def save_checkpoint(out: str, step: int, policies: dict, state: dict, unchanged: tuple = (),
                    rows: dict | None = None) -> None:
    """out/ckpt/step-N: save_state of each policy (name: (policy, with optimizer state?)), the rows
    (jsonl name: the rows logged since the previous checkpoint) appended to that checkpoint's, and
    state.json; then the rows files in out are rewritten from it and the newest KEEP_CKPTS stay.
    A policy named in `unchanged` holds the same state as in the previous checkpoint: its files are
    hard-linked from there, not written again. Non-finite state is never saved, and a failed write
    (a full disk) removes step-N.tmp and stops the run naming the bytes needed. All ranks call."""
    for name, (policy, optimizer) in policies.items():
        if not rloo.finite(policy, optimizer):
            raise RuntimeError(f"the {name}'s weights or optimizer state are not finite after step "
                               f"{step}: not saved (the last checkpoint stays as it was)")
    final = os.path.join(out, "ckpt", f"step-{step}")
    prev = (rloo.on_rank0(ckpt_dirs, out) or [None])[-1]
    tmp = final + ".tmp"
    linked = rloo.on_rank0(lambda: [n for n in unchanged
                               if prev and os.path.isdir(os.path.join(prev, n))])
    try:
        rloo.on_rank0(_begin, tmp, prev, linked, rows or {})
        for name, (policy, optimizer) in policies.items():
            if name not in linked:
                rloo.save_state(policy, os.path.join(tmp, name), optimizer)
        listing = rloo.on_rank0(lambda: {os.path.relpath(os.path.join(d, f), tmp): None
                                    for d, _, fs in os.walk(tmp) for f in fs})
        checked = [x for part in rloo.all_gather(_checked(tmp, listing)) for x in part]
        if bad := [x for x in checked if isinstance(x, str)]:
            raise OSError(bad[0])
        rloo.on_rank0(_finish, out, tmp, final, state, {r: [n, c] for r, n, c in checked})
    except (Exception, CheckpointException) as e:   # (the latter is a BaseException)
        rloo.on_rank0(shutil.rmtree, tmp, True)
        errs = [e, *[f[0] if isinstance(f, tuple) else f   # dcp's: each rank's (error, trace)
                     for f in getattr(e, "failures", {}).values()]]
        why = next((x.strerror for x in errs if isinstance(x, OSError) and x.strerror), None) \
            or data.first_line(errs[-1])
        need = sum((12 if opt else 4) * sum(p.numel() for p in rloo.trainable(policy).values())
                   for n, (policy, opt) in policies.items() if n not in linked)   # fp32 + AdamW
        free = readable(shutil.disk_usage(out).free, BYTES)
        raise UsageError(f"cannot write the checkpoint {tmp} ({why}): it needs about "
                           f"{readable(need, BYTES)}, {free} are free there; the last checkpoint "
                           "is kept, rerun to resume") from None


def set_aside(path: str) -> str:
    """rename path to path.damaged (kept for a post-mortem), or .damaged-2, -3... if a step of the
    same number was damaged before; returns the new name"""
    aside = path + ".damaged"
    n = 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.damaged-{n}"
    os.rename(path, aside)
    return aside


def _damage(ckpt: str) -> str | None:
    """what is wrong with a checkpoint folder (a file missing, cut short or changed), or None"""
    try:
        files = rloo.on_rank0(lambda: data.read_json(os.path.join(ckpt, "state.json"))["files"])
    except Exception as e:
        return f"{os.path.join(ckpt, 'state.json')} is unreadable ({e})"
    files = {r: v if isinstance(v, list) else [v, None] for r, v in files.items()}  # sizes only:
    found = [x for part in rloo.all_gather(_checked(ckpt, files)) for x in part]      # before CRCs
    return "; ".join(x for x in found if isinstance(x, str)) or None


def resume(out: str, config: dict, may_change: set) -> tuple[str, dict] | tuple[None, None]:
    """(folder, state without its config) of the newest sound checkpoint in out, or (None, None). A
    damaged one (a file missing, cut short or changed: every file's size and CRC-32 are checked,
    each rank reading its share) is reported, set aside and the one before used. Refuses one whose
    saved config differs from `config` in a setting outside may_change (it would mix runs)."""
    ckpts = rloo.on_rank0(ckpt_dirs, out)
    damaged = []
    while ckpts and (damage := _damage(ckpts[-1])):
        damaged.append(damage)
        bad = ckpts.pop()
        rloo.on_rank0(set_aside, bad)   # kept, for a post-mortem
        if ckpts:
            rloo.print0(f"resume: {damage}; resuming from {ckpts[-1]} instead", file=sys.stderr)
    if damaged and not ckpts:
        raise UsageError(f"no sound checkpoint in {out}/ckpt ({'; '.join(damaged)}); "
                           "move it away to start over")
    if not ckpts:
        return None, None
    state = rloo.on_rank0(data.read_json, os.path.join(ckpts[-1], "state.json"))
    diff = {k: (v, config.get(k)) for k, v in state["config"].items()
            if k not in may_change and config.get(k) != v}
    if diff:
        raise UsageError(f"{ckpts[-1]} was written with other settings (saved, now): {diff}; "
                         f"use another --out or the same settings")
    return ckpts[-1], {k: v for k, v in state.items() if k not in ("config", "files")}


def restore_rows(out: str, ckpt: str | None, names, quiet: bool = False) -> None:
    """(rank 0) each jsonl `names` in out becomes the copy checkpoint `ckpt` committed (rows/; empty
    without a checkpoint), in one rename: what a kill, a cut line or a garbage line left is never
    trusted. Unless quiet, a file that differed is reported."""
    if not rloo.rank0():
        return
    for name in names:
        path = os.path.join(out, name)
        src = os.path.join(ckpt or "", "rows", name)
        want = open(src, encoding="utf-8").read() if ckpt and os.path.exists(src) else ""
        have = open(path, encoding="utf-8", errors="replace").read() \
            if os.path.exists(path) else None
        if have != want:
            data.write_text(path, want)
            if have and not quiet:
                print(f"resume: {path} differed from what {ckpt or 'no checkpoint'} committed "
                      f"({have.count(chr(10))} lines, {want.count(chr(10))} committed): rewritten "
                      "from it", file=sys.stderr, flush=True)


def hf_behind(out: str, state: dict | None = None, names=("teacher", "student")) -> list[str]:
    """the HF folders `names` of soar.py run `out` that do not hold its checkpoint's state (state:
    that checkpoint's, else the newest one's): by their soar.json, the teacher's step, the student's
    promotions (it is written only when theta changes)"""
    if state is None:
        ckpts = ckpt_dirs(out)
        if not ckpts:
            return []
        state = data.read_json(os.path.join(ckpts[-1], "state.json"))
    behind = []
    for name in names:
        path = os.path.join(out, name, "soar.json")
        tag = data.read_json(path) if os.path.exists(path) else {}
        if tag.get("promotions") != state["promotions"] or \
                name == "teacher" and tag.get("step") != state["step"]:
            behind.append(f"{os.path.join(out, name)} (step {tag.get('step')}, the checkpoint's "
                          f"{state['step']})")
    return behind


# -----------------------------------------------------------------------------
# seeds, sizes, the step's counts

def seed_of(seed: int, *keys) -> int:
    """Every random draw is a function of (seed, step, ...): a resumed run replays exactly."""
    return random.Random(f"{seed}/" + "/".join(map(str, keys))).randrange(2**31)


BYTES = ((1e9, "GB"), (1e6, "MB"))   # readable()'s units for sizes


def readable(x: float, units=((1e9, "B"), (1e6, "M"))) -> str:
    """x in the largest of `units` it reaches (else the last), to 3 digits: 0.6 M, 3.21 B"""
    scale, name = next((u for u in units if x >= u[0]), units[-1])
    return f"{x / scale:.3g} {name}"


def peak_flops() -> float | None:
    """dense bf16 FLOP/s of this rank's GPU, if PEAK_TFLOPS knows it (None on CPU)"""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((1e12 * v for k, v in PEAK_TFLOPS.items() if k in name), None)


def step_counts(meter: rloo.Meter, faults_before: dict) -> dict:
    """A step's counts over all ranks: the meter's (tokens per phase, skipped updates) and the
    grading faults since `faults_before` (data.grading_faults() at the step's start)."""
    for kind, n in data.grading_faults().items():
        meter.counts[kind] = n - faults_before[kind]
    return {"skipped_updates": 0, **meter.gathered()}


def throughput(meter: rloo.Meter, faults_before: dict, flops_per_trained_token: float) -> dict:
    """step_counts, then tokens/s per GPU of each phase and, on a GPU of known peak, the MFU of
    each training phase"""
    row = step_counts(meter, faults_before)
    W = dist.get_world_size()
    peak = peak_flops()
    for phase in sorted({k.split("/")[2] for k in row if k.startswith("tokens/")}):
        n = sum(v for k, v in row.items() if k.startswith("tokens/") and k.endswith("/" + phase))
        secs = max(meter.seconds[phase], 1e-9)
        row[f"perf/tokens_per_s_per_gpu/{phase}"] = round(n / secs / W, 1)
        if peak and f"tokens/trained/{phase}" in row:
            flops = flops_per_trained_token * row[f"tokens/trained/{phase}"]
            row[f"perf/mfu/{phase}"] = round(flops / secs / (W * peak), 4)
    return row


# -----------------------------------------------------------------------------
# W&B (--wandb)

def track(wb: dict, out: str, project: str, name: str, config: dict, state: dict) -> None:
    """(rank 0, --wandb) wb = {"run": the run's W&B run, "next": the first step it does not hold}.
    Its id is kept in the checkpoint state (and in out/wandb.json until the first checkpoint): a
    resumed run continues the same W&B run. It first logs the committed rows W&B does not hold
    (tracked_steps), so each step is logged once, whatever a kill lost."""
    path = os.path.join(out, "wandb.json")
    if "wandb" not in state:
        if os.path.exists(path):
            state["wandb"] = data.read_json(path)["id"]
        else:
            state["wandb"] = secrets.token_hex(4)
        data.write_json(path, {"id": state["wandb"]})
    run = tracker(project, name, out, config, state["wandb"])
    wb.update(run=run, next=tracked_steps(run, out))
    log_rows(wb, data.read_jsonl(os.path.join(out, "metrics.jsonl")))


def log_rows(wb: dict, rows: list[dict]) -> None:
    """(rank 0) each metrics row W&B does not hold yet, at its step"""
    for r in rows:
        if r["step"] >= wb["next"]:
            wb["run"].log(r, step=r["step"])
            wb["next"] = r["step"] + 1


def tracker(project: str, name: str, folder: str, config: dict, run_id: str | None = None):
    """(rank 0; --wandb PROJECT) a W&B run logging to folder/wandb, with `config` as its config,
    continuing run `run_id` when given. wandb is imported here only: a run without --wandb never
    loads it. Silent; WANDB_MODE=offline writes it there without a network (`wandb sync` later)."""
    import wandb
    # a W&B service of our own: one inherited from a parent (its address is left in WANDB_SERVICE)
    # may still hold this run's id, for a process that was killed, and would hang this init
    os.environ.pop("WANDB_SERVICE", None)
    try:
        return wandb.init(project=project, name=name or None, id=run_id, dir=folder,
                          config=config, resume="allow" if run_id else None,
                          settings=wandb.Settings(silent=True, console="off"))  # console: ours
    except wandb.errors.Error as e:   # no login, no network: one line, before any step
        raise UsageError(f"--wandb {project}: W&B did not start ({data.first_line(e)}); log "
                           "in (`wandb login`) or set WANDB_MODE=offline") from None


def tracked_steps(run, folder: str) -> int:
    """The first step W&B does not hold of `run` (a tracker's): online, what the resumed run says;
    offline, where W&B cannot resume (wandb#2423), each process writes an offline run of the id, and
    what they hold is in their .wandb files. W&B flushes those now and then, so a kill loses the
    last rows it was sent: they are read, not trusted."""
    if run.settings.mode != "offline":
        return run.step
    paths = glob.glob(os.path.join(folder, "wandb", f"offline-run-*-{run.id}", "*.wandb"))
    return 1 + max((r.history.step.num for p in paths for r in wandb_records(p)
                    if r.HasField("history")), default=-1)


def wandb_records(path: str):
    """The protobuf Records of a W&B .wandb file, a LevelDB-style log: a 7-byte file header, then
    32 KiB blocks of records, each behind a 7-byte header (CRC, length, type 1 full, 2 first,
    3 middle, 4 last). The end a kill cut is left out."""
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


