"""
The run plumbing soar.py and eval.py share beside the RL engine (rloo.py): the process group and
the decisions made once on rank 0, one run per folder, sharded checkpoints that a resume checks and
falls back from, the rows files rewritten from them, seeds, timers and counts, flags from a
dataclass, W&B, and a clean one-line exit.
"""
import argparse
import atexit
import dataclasses
import fcntl
import glob
import inspect
import json
import os
import random
import re
import shutil
import socket
import struct
import sys
import time
import zlib
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import data

# -----------------------------------------------------------------------------
KEEP_CKPTS = 2              # checkpoints kept: a damaged newest one falls back to the one before
# dense bf16 peak of one GPU, for the MFU estimate in metrics.jsonl (spec sheets, SXM parts)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}
ENGINES = []                # this process's vLLM engines (rloo.build_engine); clean_exit stops them
# -----------------------------------------------------------------------------


# -----------------------------------------------------------------------------
# processes: the group, decisions made once on rank 0, shares of work

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """rank, world size, device. A plain `python script.py` becomes a 1-rank group, so the
    same code path (external_launcher engine, FSDP2) runs with and without torchrun."""
    cuda = torch.cuda.is_available()
    if "TORCHELASTIC_RUN_ID" in os.environ:   # under torchrun: never outlive the launcher (a killed
        data.die_with_parent()               # launcher's orphans would go on writing into --out)
    if not dist.is_initialized():
        for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo",
                                device_id=torch.device("cuda", torch.cuda.current_device())
                                if cuda else None)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


def rank0() -> bool:
    """Does this rank print and write the run's shared files? (before init: torchrun's RANK)"""
    return dist.get_rank() == 0 if dist.is_initialized() else os.environ.get("RANK", "0") == "0"


def print0(*args, **kwargs) -> None:
    if rank0():
        print(*args, **{"flush": True, **kwargs})


def on_rank0(fn, *args):
    """fn(*args) on rank 0 alone, its result (or its error) on every rank: what rests on a timeout
    or on the filesystem (a problem list, a lock, a checkpoint's listing) is decided once, so ranks
    never disagree nor wait on a rank that failed alone. Before init_distributed: just fn(*args)."""
    if not dist.is_initialized():
        return fn(*args)
    res = None
    if rank0():
        try:
            res = (fn(*args), None)
        except Exception as e:   # raised on every rank; types clean_exit reports in one line
            res = (None, e if isinstance(e, (RuntimeError, ValueError, OSError))
                   else RuntimeError(f"{type(e).__name__}: {e}"))
    value, err = all_gather(res)[0]
    if err is not None:
        raise err
    return value


def chunk(n: int, rank: int, world: int) -> tuple[int, int]:
    """contiguous [lo, hi) share of n items for rank (the first n % world ranks get one more)"""
    q, r = divmod(n, world)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (rank < r)


def my_share(items: list, group=None) -> list:
    """this rank's contiguous share of items (chunk) within group"""
    lo, hi = chunk(len(items), dist.get_rank(group), dist.get_world_size(group))
    return items[lo:hi]


def all_gather(obj, group=None) -> list:
    """every rank's obj (any picklable object), in rank order, on every rank of group"""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return parts


def split_map(fn, items: list, group=None) -> list:
    """fn over this rank's share of items, results gathered on every rank of group. Used for
    grading and parsing: one rank decides each item, so ranks never disagree on a timeout."""
    if not dist.is_initialized():
        return fn(items)
    return [x for part in all_gather(fn(my_share(items, group)), group) for x in part]


# -----------------------------------------------------------------------------
# one run per folder

_LOCKS = []   # lock files this process holds (lock_folder); the kernel releases them when it dies


def lock_folder(folder: str) -> None:
    """One run per folder: rank 0 locks folder/.lock for the process's life (flock; on a filesystem
    without it, a file .lock.pid made with O_EXCL). A second run on the folder stops at once with an
    error naming the folder and the live process; a dead run's lock never blocks its resume (flock
    goes with its process; a .lock.pid naming a dead pid of this host is taken over). All call."""
    on_rank0(_lock, folder)


def _lock(folder: str) -> None:
    me = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    busy = f"{folder} is in use by a live run ({{}}); wait for it to end, stop it, or choose " \
           "another folder"
    try:
        os.makedirs(folder, exist_ok=True)
        f = open(os.path.join(folder, ".lock"), "a+")
    except OSError as e:
        raise RuntimeError(f"{folder}: cannot write there ({e.strerror})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise RuntimeError(busy.format(f.read().strip() or "another process")) from None
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
                    raise RuntimeError(busy.format(holder) + f" (if none is, remove {path})")
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
# checkpoints: out/ckpt/step-N holds all a restart needs: save_state per policy, the run's jsonl
# rows up to step N (rows/), and state.json, which lists every file's size and CRC-32 (resume
# checks them); it is made as step-N.tmp and appears in one rename

def reshard(model):
    # FSDP2 leaves the root unsharded after a forward with no backward (e.g. no_grad): reshard all
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _state(policy, optimizer: bool) -> dict:
    reshard(policy.model)
    msd, osd = (get_state_dict(policy.model, policy.optimizer) if optimizer
                else (get_model_state_dict(policy.model), None))
    if policy.model.lm_head.weight is policy.model.get_input_embeddings().weight:   # tied: once
        msd.pop("lm_head.weight", None)
    return {"model": msd, "optim": osd, "sched": policy.scheduler.state_dict()} if optimizer \
        else {"model": msd}


def finite(policy, optimizer: bool = True) -> bool:
    """are the weights (and AdamW moments) finite on every rank of the policy's mesh?"""
    ts = list(policy.model.parameters()) + ([t for st in policy.optimizer.state.values()
                                             for t in st.values() if t.dim()] if optimizer else [])
    ok = torch.stack([torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all()
                      for t in ts]).all().float()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=policy.mesh.get_group())
    return bool(ok.item())


def save_state(policy, path: str, optimizer: bool = True) -> None:
    """The weights and, if `optimizer`, the AdamW and schedule state, sharded (torch.distributed.
    checkpoint; all ranks of the job call; the folder must be on a filesystem all ranks see). On a
    sub-mesh (students) the groups' copies are deduplicated, so must hold the same weights (theta).
    Not atomic itself: save_checkpoint writes it in a folder that appears in one rename."""
    dcp.save(_state(policy, optimizer), checkpoint_id=path)


def load_state(policy, path: str, optimizer: bool = True) -> None:
    state = _state(policy, optimizer)
    dcp.load(state, checkpoint_id=path)
    opts = StateDictOptions(strict=False)   # lm_head.weight: tied, loaded as the embedding
    if optimizer:
        set_state_dict(policy.model, policy.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=opts)
        policy.scheduler.load_state_dict(state["sched"])
    else:
        set_model_state_dict(policy.model, state["model"], options=opts)
    if not finite(policy, optimizer):
        raise RuntimeError(f"{path} holds non-finite weights or optimizer state; move its "
                           "checkpoint aside to resume from the one before")


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
            crc = zlib.crc32(block, crc)   # 1.3 GB/s on one core
    return crc


def _checked(folder: str, files: dict) -> list:
    """every rank reads its share of folder's `files` (relative path: [size, crc] or None to
    compute): the (path, size, crc) of each file of the share, or what is wrong with it"""
    mine = []
    for rel in sorted(files)[dist.get_rank()::dist.get_world_size()]:
        path, want = os.path.join(folder, rel), files[rel]
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
        if not finite(policy, optimizer):
            raise RuntimeError(f"the {name}'s weights or optimizer state are not finite after step "
                               f"{step}: not saved (the last checkpoint stays as it was)")
    final = os.path.join(out, "ckpt", f"step-{step}")
    prev = (on_rank0(ckpt_dirs, out) or [None])[-1]
    tmp = final + ".tmp"
    linked = on_rank0(lambda: [n for n in unchanged
                               if prev and os.path.isdir(os.path.join(prev, n))])
    try:
        on_rank0(_begin, tmp, prev, linked, rows or {})
        for name, (policy, optimizer) in policies.items():
            if name not in linked:
                save_state(policy, os.path.join(tmp, name), optimizer)
        listing = on_rank0(lambda: {os.path.relpath(os.path.join(d, f), tmp): None
                                    for d, _, fs in os.walk(tmp) for f in fs})
        checked = [x for part in all_gather(_checked(tmp, listing)) for x in part]
        if bad := [x for x in checked if isinstance(x, str)]:
            raise OSError(bad[0])
        on_rank0(_finish, out, tmp, final, state, {r: [n, c] for r, n, c in checked})
    except (Exception, CheckpointException) as e:   # (the latter is a BaseException)
        on_rank0(shutil.rmtree, tmp, True)
        errs = [e, *[f[0] if isinstance(f, tuple) else f   # dcp's: each rank's (error, trace)
                     for f in getattr(e, "failures", {}).values()]]
        why = next((x.strerror for x in errs if isinstance(x, OSError) and x.strerror), None) \
            or data.first_line(errs[-1])
        need = sum((12 if opt else 4) * sum(p.numel() for p in policy.model.parameters())
                   for n, (policy, opt) in policies.items() if n not in linked)   # fp32 + AdamW
        free = readable(shutil.disk_usage(out).free, BYTES)
        raise RuntimeError(f"cannot write the checkpoint {tmp} ({why}): it needs about "
                           f"{readable(need, BYTES)}, {free} are free there; the last checkpoint "
                           "is kept, rerun to resume") from None


def set_aside(path: str) -> str:
    """rename path to path.damaged (kept for a post-mortem), or .damaged-2, -3... if a step of the
    same number was damaged before; returns the new name"""
    aside, n = path + ".damaged", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{path}.damaged-{n}"
    os.rename(path, aside)
    return aside


def _damage(ckpt: str) -> str | None:
    """what is wrong with a checkpoint folder (a file missing, cut short or changed), or None"""
    try:
        files = on_rank0(lambda: data.read_json(os.path.join(ckpt, "state.json"))["files"])
    except Exception as e:
        return f"{os.path.join(ckpt, 'state.json')} is unreadable ({e})"
    files = {r: v if isinstance(v, list) else [v, None] for r, v in files.items()}  # sizes only:
    found = [x for part in all_gather(_checked(ckpt, files)) for x in part]      # before CRCs
    return "; ".join(x for x in found if isinstance(x, str)) or None


def resume(out: str, config: dict, may_change: set) -> tuple[str, dict] | tuple[None, None]:
    """(folder, state without its config) of the newest sound checkpoint in out, or (None, None). A
    damaged one (a file missing, cut short or changed: every file's size and CRC-32 are checked,
    each rank reading its share) is reported, set aside and the one before used. Refuses one whose
    saved config differs from `config` in a setting outside may_change (it would mix runs)."""
    ckpts, damaged = on_rank0(ckpt_dirs, out), []
    while ckpts and (damage := _damage(ckpts[-1])):
        damaged.append(damage)
        bad = ckpts.pop()
        on_rank0(set_aside, bad)   # kept, for a post-mortem
        if ckpts:
            print0(f"resume: {damage}; resuming from {ckpts[-1]} instead", file=sys.stderr)
    if damaged and not ckpts:
        raise RuntimeError(f"no sound checkpoint in {out}/ckpt ({'; '.join(damaged)}); "
                           "move it away to start over")
    if not ckpts:
        return None, None
    state = on_rank0(data.read_json, os.path.join(ckpts[-1], "state.json"))
    diff = {k: (v, config.get(k)) for k, v in state["config"].items()
            if k not in may_change and config.get(k) != v}
    if diff:
        raise ValueError(f"{ckpts[-1]} was written with other settings (saved, now): {diff}; "
                         f"use another --out or the same settings")
    return ckpts[-1], {k: v for k, v in state.items() if k not in ("config", "files")}


def restore_rows(out: str, ckpt: str | None, names, quiet: bool = False) -> None:
    """(rank 0) each jsonl `names` in out becomes the copy checkpoint `ckpt` committed (rows/; empty
    without a checkpoint), in one rename: what a kill, a cut line or a garbage line left is never
    trusted. Unless quiet, a file that differed is reported."""
    if not rank0():
        return
    for name in names:
        path, src = os.path.join(out, name), os.path.join(ckpt or "", "rows", name)
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
# seeds, timers, counts

def seed_of(seed: int, *keys) -> int:
    """Every random draw is a function of (seed, step, ...): a resumed run replays exactly."""
    return random.Random(f"{seed}/" + "/".join(map(str, keys))).randrange(2**31)


TIMES = defaultdict(float)   # seconds per key since the caller last cleared it
COUNTS = defaultdict(int)    # this rank's count(kind, n) totals, keyed "<kind>/<timer key>"
_open = []                   # [key, seconds spent in nested blocks] of the open timed() blocks


@contextmanager
def timed(key: str):
    """Exclusive timers: time spent in a nested timed() block counts only for the inner key."""
    t0 = time.perf_counter()
    _open.append([key, 0.0])
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        TIMES[key] += dt - _open.pop()[1]
        if _open:
            _open[-1][1] += dt


def peak_flops() -> float | None:
    """dense bf16 FLOP/s of this rank's GPU, if PEAK_TFLOPS knows it (None on CPU)"""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((1e12 * v for k, v in PEAK_TFLOPS.items() if k in name), None)


def count(kind: str, n: int = 1) -> None:
    """n (tokens generated/trained, updates skipped) on this rank, under the innermost open timer"""
    COUNTS[f"{kind}/{_open[-1][0] if _open else 'other'}"] += n


def reset_counts() -> None:
    COUNTS.clear()
    data.GRADING_FAULTS.update(dict.fromkeys(data.GRADING_FAULTS, 0))


def gather_counts() -> dict:
    """The counts since reset_counts, summed over all ranks: grading_timeouts, grading_errors
    (data.GRADING_FAULTS), skipped_updates, tokens/{generated,trained}/<timer key>"""
    total = defaultdict(int)
    for part in all_gather({**COUNTS, **data.GRADING_FAULTS}):
        for k, v in part.items():
            total[k.split("/")[0] if k.startswith("skipped_updates/") or k in data.GRADING_FAULTS
                  else "tokens/" + k] += v
    return dict(sorted(total.items()))


BYTES = ((1e9, "GB"), (1e6, "MB"))   # readable()'s units for sizes


def readable(x: float, units=((1e9, "B"), (1e6, "M"))) -> str:
    """x in the largest of `units` it reaches (else the last), to 3 digits: 0.6 M, 3.21 B"""
    scale, name = next((u for u in units if x >= u[0]), units[-1])
    return f"{x / scale:.3g} {name}"


# -----------------------------------------------------------------------------
# flags, W&B, the exit

def config_parser(cls, preset: dict, **kwargs) -> argparse.ArgumentParser:
    """A parser with a --flag per field of dataclass `cls`; help: the field's trailing comment, its
    default and, if any, the value in `preset` (the built-in world's, used without --model)."""
    p = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    helps = dict(re.findall(r"^\s+(\w+): [^=\n]+=[^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))
    for f in dataclasses.fields(cls):
        h = f"{helps.get(f.name, '')} (default {f.default!r}"
        h = (h + (f"; built-in world {preset[f.name]!r})" if f.name in preset
                  else ")")).replace("%", "%%")
        if f.type is bool:
            p.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=None,
                           help=h)
        else:
            p.add_argument(f"--{f.name}", type=f.type, default=None,
                           metavar=f.type.__name__.upper(), help=h)
    return p


def too_small(cfg, least: dict) -> list[str]:
    """what is wrong with cfg's counts: `least` maps a least value to the flags it bounds"""
    return [f"--{f} {getattr(cfg, f)}: need at least {m}" for m, fs in least.items() for f in fs
            if getattr(cfg, f) < m]


def config_from(cls, args: dict, preset: dict):
    """An instance of `cls`: the flags given, else (without --model: the built-in world) the preset,
    else the field defaults (with --model: the paper's settings)."""
    names = {f.name for f in dataclasses.fields(cls)}
    flags = {k: v for k, v in args.items() if k in names and v is not None}
    base = {} if flags.get("model") else {k: v for k, v in preset.items() if k in names}
    return cls(**{**base, **flags})


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
        raise RuntimeError(f"--wandb {project}: W&B did not start ({data.first_line(e)}); log "
                           "in (`wandb login`) or set WANDB_MODE=offline") from None


def tracked_steps(run, folder: str) -> int:
    """The first step W&B does not hold of `run` (a tracker's): online, what the resumed run says;
    offline, where W&B cannot resume (wandb#2423), each process writes an offline run of the id, and
    what they hold is in their .wandb files. W&B flushes those every 15 s, so a kill loses the last
    rows it was sent: they are read, not trusted."""
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
    pos, part = 7, b""
    while pos + 7 <= len(b):
        _, n, kind = struct.unpack("<IHB", b[pos:pos + 7])
        if (left := 32768 - pos % 32768) < 7 or kind == 0 or pos + 7 + n > len(b):
            pos += left   # a block's padding, or the cut end
            continue
        part, pos = part + b[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            (rec := pb.Record()).ParseFromString(part)
            yield rec
            part = b""


@contextmanager
def clean_exit(script: str):
    """Around a script's main: a RuntimeError, ValueError or OSError ends the run with a one-line
    message on rank 0 and exit code 1, and so does a SystemExit("message") (the other ranks exit 1
    silently). The engines shut down before the process group goes (their shutdown tears down
    vLLM's groups, the default one too; left to the interpreter's exit, it fails)."""
    try:
        yield
    except (RuntimeError, ValueError, OSError) as e:
        print0(f"{script}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except SystemExit as e:
        if isinstance(e.code, str) and not rank0():
            raise SystemExit(1) from None
        raise
    finally:
        for llm in ENGINES:
            llm.llm_engine.engine_core.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
