"""What a launched script needs around the method (soar.py, eval.py): its flags, its exit, one run
per folder, sharded checkpoints that a resume checks and falls back from, the rows files rewritten
from them, seeds, the step's counts, W&B, and SOAR's run (its settings check with the GPU memory
estimate, models and saving).
The RL engine itself is rloo.py; the text side is data.py.
"""
import argparse
import atexit
import dataclasses
import fcntl
import glob
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
import pickle
import traceback
import zlib
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

import data
import lora
import rloo
import rloo_extras

# -----------------------------------------------------------------------------
KEEP_CKPTS = 2              # checkpoints kept: a damaged newest one falls back to the one before
# dense bf16 peak of one GPU, for the MFU estimate in metrics.jsonl (spec sheets, SXM parts)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}
USAGE_EXIT = 2              # a usage error's exit code (argparse's too); run.sh knows it
# GPU memory per rank (memory_per_rank; METHOD.md "Scale layout", docs/scale.md "GPU memory")
GIB = 2 ** 30
HELD_BYTES = 12             # a trained parameter from update to update: fp32 weight, 2 moments
GRAD_BYTES = 4              # ... and its fp32 gradient, only while its policy trains (freed after)
# activations and transient buffers of one micro-batch, from H200 peaks of Llama-3.2-3B (vocabulary
# 128256, width 3072, 28 layers) less what rests between steps (docs/scale.md "The activation
# measurement" derives the three parts): a fixed part, the vocabulary head's chunk, a part per token
ACTIVATION_REF = (128256, 3072, 28)   # the vocabulary, width and depth they were measured at
ACTIVATION_FIXED_GIB = 1.7  # the root's unsharded embedding and its fp32 gradient: x vocab x width
ACTIVATION_HEAD_GIB = 1.63e-3   # a token of the head's chunk (rloo.LOGIT_CHUNK_TOKENS): its
                                # logits in bf16 and fp32, recomputed, and their gradient: x vocab
ACTIVATION_TOKEN_GIB = 4.19e-4  # a micro-batch token: the checkpointed layer inputs and one layer's
                                # recompute: x width x depth
NO_CHECKPOINT_FACTOR = 8.7  # the per-token part without activation checkpointing
CONTEXT_GIB = 3.0           # a margin for the CUDA context, cuBLAS workspaces and NCCL's buffers
# host RAM per rank (host_memory): theta and the promotion candidates, fp32 shards
# (rloo_extras.snapshot), may take this share of a rank's part of the host's RAM; the rest is for
# the processes themselves
SNAPSHOT_BYTES = 4
HOST_SHARE = 0.5
# GPU engines: vLLM's default prefill batch on large GPUs; the activations it profiles for it come
# off the KV cache, so step_engine_args asks for no more than a step's prompts (at least MIN)
ENGINE_MAX_BATCHED_TOKENS = 16384
ENGINE_MIN_BATCHED_TOKENS = 2048
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
    if "TORCHELASTIC_RUN_ID" in os.environ:   # under torchrun: a killed launcher leaves no rank
        data.die_with_parent()                 # running on (or writing into a run folder)
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
# decisions made once: on rank 0 for all, or checked alike on every rank

def on_rank0(fn, *args):
    """fn(*args) on rank 0 alone, its result (or its error) on every rank: what rests on a timeout
    or on the filesystem (a problem list, a lock, a checkpoint's listing) is decided once, so ranks
    never disagree nor wait on a rank that failed alone. Rank 0 raises the error itself, traceback
    and all; the other ranks raise a copy marked `from_rank0`, with rank 0's traceback as a note.
    Before init_distributed: just fn(*args)."""
    if not dist.is_initialized():
        return fn(*args)
    res = None
    err = None
    if rloo.rank0():
        try:
            res = (fn(*args), None, None)
        except Exception as e:
            err = e
            try:
                pickle.dumps(e)
                copy = e
            except Exception:   # an exception that does not pickle travels as its text
                copy = RuntimeError(f"{type(e).__name__}: {e}")
            res = (None, copy, traceback.format_exc())
    value, copy, trace = rloo.all_gather(res)[0]
    if err is not None:
        raise err
    if copy is not None:
        copy.from_rank0 = True
        copy.add_note(f"(raised on rank 0)\n{trace}")
        raise copy
    return value


def check_same(value, what: str, group=None) -> None:
    """Raise on every rank if the ranks of group hold different values of `what` (what a
    collective that follows relies on), naming each value and its ranks: one clear error in place
    of a hang until the collectives' timeout. Values are compared by repr, so NaN equals NaN."""
    parts = rloo.all_gather(value, group)
    if all(repr(part) == repr(parts[0]) for part in parts):
        return
    ranks = defaultdict(list)
    for rank, part in enumerate(parts):
        ranks[repr(part)].append(rank)
    err = RuntimeError(f"{what} differs between ranks: " + "; ".join(
        f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {v}" for v, r in ranks.items()))
    err.from_rank0 = not rloo.rank0()   # every rank knows it: rank 0 alone prints it (launch.main)
    raise err


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
    return on_rank0(load)


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
# checkpoints: out/ckpt/step-N holds all a restart needs: rloo_extras.save_state per policy, the
# run's jsonl rows up to step N (rows/), and state.json, which lists every file's size and CRC-32
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
        if not rloo_extras.finite(policy, optimizer):
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
                rloo_extras.save_state(policy, os.path.join(tmp, name), optimizer)
        listing = on_rank0(lambda: {os.path.relpath(os.path.join(d, f), tmp): None
                                    for d, _, fs in os.walk(tmp) for f in fs})
        checked = [x for part in rloo.all_gather(_checked(tmp, listing)) for x in part]
        if bad := [x for x in checked if isinstance(x, str)]:
            raise OSError(bad[0])
        on_rank0(_finish, out, tmp, final, state, {r: [n, c] for r, n, c in checked})
    except (Exception, CheckpointException) as e:   # (the latter is a BaseException)
        on_rank0(shutil.rmtree, tmp, True)
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
        files = on_rank0(lambda: data.read_json(os.path.join(ckpt, "state.json"))["files"])
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
    ckpts = on_rank0(ckpt_dirs, out)
    damaged = []
    while ckpts and (damage := _damage(ckpts[-1])):
        damaged.append(damage)
        bad = ckpts.pop()
        on_rank0(set_aside, bad)   # kept, for a post-mortem
        if ckpts:
            rloo.print0(f"resume: {damage}; resuming from {ckpts[-1]} instead", file=sys.stderr)
    if damaged and not ckpts:
        raise UsageError(f"no sound checkpoint in {out}/ckpt ({'; '.join(damaged)}); "
                           "move it away to start over")
    if not ckpts:
        return None, None
    state = on_rank0(data.read_json, os.path.join(ckpts[-1], "state.json"))
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


def finished(out: str, outer_steps: int) -> bool:
    """(rank 0) does soar.py run `out` hold all outer_steps, its HF folders included?"""
    ckpts = ckpt_dirs(out)
    state = data.read_json(os.path.join(ckpts[-1], "state.json")) if ckpts else {"step": 0}
    return state["step"] >= outer_steps and not hf_behind(out, state)


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
# what a step spent: seconds per phase, and the tokens and events rloo counted under each

class Meter:
    """Exclusive timers and counts of one step: time in a nested timed() block counts only for
    the inner phase, and so do the rloo.COUNTS it adds (tokens "generated", "trained";
    "skipped_updates"); what was counted outside every phase goes to "other"."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = defaultdict(float)   # phase: seconds
        self.counts = defaultdict(int)      # "<kind>/<phase>": n, on this rank
        self._open = []                     # [phase, seconds of nested blocks, their counts]
        self._start = dict(rloo.COUNTS)     # rloo's counts when the step started

    @contextmanager
    def timed(self, phase: str):
        """with timed(phase): the block's seconds and counts, less its nested blocks', to phase"""
        t0 = time.perf_counter()
        before = dict(rloo.COUNTS)
        self._open.append([phase, 0.0, defaultdict(int)])
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            _, nested_seconds, nested = self._open.pop()
            self.seconds[phase] += dt - nested_seconds
            added = {kind: n - before.get(kind, 0) for kind, n in rloo.COUNTS.items()}
            for kind, n in added.items():
                if n - nested[kind]:
                    self.counts[f"{kind}/{phase}"] += n - nested[kind]
            if self._open:
                self._open[-1][1] += dt
                for kind, n in added.items():
                    self._open[-1][2][kind] += n

    def gathered(self, group=None) -> dict:
        """the counts summed over the ranks of group: skipped_updates as one number, tokens as
        tokens/{generated,trained}/<phase>, any other kind under its own name"""
        counts = defaultdict(int, self.counts)
        for kind, n in rloo.COUNTS.items():   # what no phase counted
            outside = n - self._start.get(kind, 0) - sum(
                v for key, v in self.counts.items() if key.split("/")[0] == kind)
            if outside:
                counts[f"{kind}/other"] += outside
        total = defaultdict(int)
        for part in rloo.all_gather(dict(counts), group):
            for key, n in part.items():
                kind = key.split("/")[0]
                if kind in ("generated", "trained"):
                    total["tokens/" + key] += n
                else:
                    total[kind] += n
        return dict(sorted(total.items()))


# The process's meter: rloo.timed(phase) blocks are its phases (rloo.TIMER), and the scripts'
# own with rloo.timed(phase); the harness reads it and resets it at the start of a step.
METER = Meter()
rloo.TIMER = METER.timed


# -----------------------------------------------------------------------------
# sizes, the step's counts

BYTES = ((1e9, "GB"), (1e6, "MB"))   # readable()'s units for sizes


def readable(x: float, units=((1e9, "B"), (1e6, "M"))) -> str:
    """x in the largest of `units` it reaches (else the last), to 3 digits: 0.6 M, 3.21 B"""
    scale, name = next((u for u in units if x >= u[0]), units[-1])
    return f"{x / scale:.3g} {name}"


def peak_flops() -> float | None:
    """dense bf16 FLOP/s of this rank's GPU, if PEAK_TFLOPS knows it (None on CPU)"""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((1e12 * v for k, v in PEAK_TFLOPS.items() if k in name), None)


def step_counts(faults_before: dict) -> dict:
    """A step's counts over all ranks: METER's (tokens per phase, skipped updates) and the
    grading faults since `faults_before` (data.grading_faults() at the step's start)."""
    for kind, n in data.grading_faults().items():
        METER.counts[kind] = n - faults_before[kind]
    return {"skipped_updates": 0, **METER.gathered()}


def throughput(faults_before: dict, flops_per_trained_token: float) -> dict:
    """step_counts, then tokens/s per GPU of each phase and, on a GPU of known peak, the MFU of
    each training phase"""
    row = step_counts(faults_before)
    W = dist.get_world_size()
    peak = peak_flops()
    for phase in sorted({k.split("/")[2] for k in row if k.startswith("tokens/")}):
        n = sum(v for k, v in row.items() if k.startswith("tokens/") and k.endswith("/" + phase))
        secs = max(METER.seconds[phase], 1e-9)
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
    resumed run continues the same W&B run (W&B's resume), which says what it holds (run.step).
    Then it logs the committed rows W&B does not hold, so each step is logged once."""
    path = os.path.join(out, "wandb.json")
    if "wandb" not in state:
        if os.path.exists(path):
            state["wandb"] = data.read_json(path)["id"]
        else:
            state["wandb"] = secrets.token_hex(4)
        data.write_json(path, {"id": state["wandb"]})
    run = tracker(project, name, out, config, state["wandb"])
    if run.settings.mode == "offline":
        drop_older_offline_runs(run)
    wb.update(run=run, next=run.step)
    log_rows(wb, data.read_jsonl(os.path.join(out, "metrics.jsonl")))


def drop_older_offline_runs(run) -> None:
    """Offline, W&B cannot resume (wandb#2423): each process writes a new offline run of the id,
    from step 0, so it logs every committed row again. The offline runs of the id that earlier
    processes left are deleted: the newest holds what they did, and what a kill kept them from
    writing. So `wandb sync` uploads one run that holds each step once."""
    here = os.path.dirname(run.dir)   # <out>/wandb/offline-run-<time>-<id>[-<n>]
    for folder in glob.glob(os.path.join(os.path.dirname(here), "offline-run-*")):
        if re.search(f"-{run.id}(-[0-9]+)?$", folder) and folder != here:
            shutil.rmtree(folder, ignore_errors=True)


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


# -----------------------------------------------------------------------------
# SOAR's run (soar.py): what makes it start, resume and leave outputs. soar.py calls start(), then
# for each outer step steps() and commit(), then finish(); the method reads the SoarRun's fields.

SOAR_OUTPUTS = ("metrics.jsonl", "pq.jsonl", "questions.jsonl")   # the rows a step commits
# settings a resumed run may change without invalidating its checkpoint
SOAR_MAY_CHANGE = {"outer_steps", "out", "micro_batch_tokens", "activation_checkpointing",
                   "prompt_pass", "gpu_memory_utilization", "save_every", "verbose", "wandb",
                   "wandb_name"}


@dataclasses.dataclass
class SoarRun:
    mesh: object                # 2-D ("group", "fsdp") device mesh: G student groups x W/G ranks
    tok: object
    llm: object                 # this rank's engine
    teacher: rloo.Policy
    student: rloo.Policy        # this group's student: theta, and the one it trains
    adapters: list              # with LoRA, an adapter for each of the group's students, trained
                                # side by side (the first is student); else []
    theta: dict                 # the baseline student's shards (rloo_extras.snapshot)
    hard: list                  # the hard train split
    state: dict                 # what a checkpoint holds besides the weights
    n_params: int
    wandb: dict                 # rank 0 with --wandb: the W&B run (track); else empty
    step_start: tuple = ()      # (time, data.grading_faults()) at this step's start (steps)


def start(cfg, trains_students: bool) -> SoarRun | None:
    """The run folder (locked, settings checked), the checkpoint to resume from, W&B, then the
    models (load_models): a SoarRun, or None if the run is finished (its HF folders written)"""
    _, world_size, device = rloo.init_distributed()
    tok = tokenizer(cfg.model)
    if not cfg.train:
        raise UsageError("--train is required with --model: the hard train split "
                         "(jsonl/parquet, question/answer)")
    hard, seq_len = open_folder(cfg, tok, world_size, trains_students)
    try:
        ckpt, state = resume(cfg.out, dataclasses.asdict(cfg), SOAR_MAY_CHANGE)
    except UsageError as e:   # other settings: refused, finished or not (a script that loops
        if on_rank0(finished, cfg.out, cfg.outer_steps):   # over settings must not reuse it)
            raise UsageError(f"{cfg.out} is finished (all {cfg.outer_steps} steps), and {e}") \
                from None
        raise
    state = state or dict(step=0, history=[], promotions=0, pq=0, archive=[])
    restore_rows(cfg.out, ckpt, SOAR_OUTPUTS)   # the files hold exactly the committed steps
    wb = {}   # rank 0 with --wandb: the W&B run and the first step it does not hold
    if cfg.wandb:   # its error (no login) ends every rank
        on_rank0(track, wb, cfg.out, cfg.wandb, cfg.wandb_name, dataclasses.asdict(cfg),
                      state)
    if state["step"] >= cfg.outer_steps and not on_rank0(hf_behind, cfg.out, state):
        rloo.print0(f"{cfg.out}: all {cfg.outer_steps} steps are done already; nothing to do")
        return None
    run = load_models(cfg, device, world_size, tok, seq_len, hard, ckpt, state, wb)
    if state["step"] >= cfg.outer_steps:   # finished, killed while writing teacher/, student/
        save_soar_folders(cfg, run)
        return None
    return run


def steps(cfg, run: SoarRun):
    """The outer steps still to run, behind a progress bar (rank 0); each resets METER"""
    first = run.state["step"]
    for step in tqdm(range(first, cfg.outer_steps), initial=first, total=cfg.outer_steps,
                     disable=not rloo.rank0(), desc="SOAR", dynamic_ncols=True):
        METER.reset()
        run.step_start = (time.perf_counter(), data.grading_faults())
        yield step


def commit(cfg, run: SoarRun, rows: dict, promoted: bool, line) -> None:
    """The step's end: its metrics row gains the step's seconds by phase and its throughput; then
    nothing in --out gets ahead of the checkpoint: first the checkpoint, which commits the step
    with its rows (the SOAR_OUTPUTS files are then rewritten from it); then W&B's copy of the
    metrics row (--wandb); then, every save_every steps and at the end, the HF folders teacher/
    and student/. Last, line(metrics row) on the console."""
    t0, faults_before = run.step_start
    (row,) = rows["metrics.jsonl"]
    row.update({k: round(v, 3) for k, v in METER.seconds.items()})
    row["total"] = round(time.perf_counter() - t0, 3)
    row.update(soar_throughput(cfg, run, faults_before))
    state = run.state
    # checkpoint and outputs hold theta, not the last student
    rloo_extras.restore(run.student, run.theta)
    save_checkpoint(cfg.out, state["step"],
                    {"teacher": (run.teacher, True), "student": (run.student, False)},
                    {**state, "config": dataclasses.asdict(cfg)},
                    unchanged=() if promoted else ("student",), rows=rows)
    if run.wandb:
        log_rows(run.wandb, rows["metrics.jsonl"])
    if state["step"] % cfg.save_every == 0 or state["step"] >= cfg.outer_steps:
        save_soar_folders(cfg, run)
    if rloo.rank0():
        tqdm.write(line(row))


def finish(cfg, run: SoarRun) -> None:
    """the run's last line, and W&B's run closed"""
    rloo.print0(f"done: {cfg.out}/metrics.jsonl, {cfg.out}/pq.jsonl ({run.state['pq']} promotion "
                f"questions), {cfg.out}/teacher, {cfg.out}/student")
    if run.wandb:
        run.wandb["run"].finish()


def soar_throughput(cfg, run: SoarRun, faults_before: dict) -> dict:
    """The step's counts and speeds (throughput); a trained token costs 6N FLOP, 8N with the KL
    reference's forward (attention and recomputation left out); with LoRA 4N and 6N (the frozen
    base gets no weight gradients; the adapters' FLOPs left out)."""
    flops_per_token = (4 if cfg.lora_rank else 6) + 2 * (cfg.kl_coef > 0)
    return throughput(faults_before, flops_per_token * run.n_params)


def save_soar_folders(cfg, run: SoarRun) -> None:
    """teacher/ and (when theta changed since it was written) student/, HF folders with soar.json
    saying what they hold (the teacher's: how it samples, too); the student's weights must be
    theta"""
    state = run.state
    tag = {"step": state["step"], "promotions": state["promotions"]}
    # how the teacher samples (eval.answer_form), wherever its folder is copied to
    turns = {"teacher_turns": cfg.teacher_turns, "answer_prompt": cfg.answer_prompt}
    rloo_extras.save_hf(run.teacher, os.path.join(cfg.out, "teacher"), run.tok, state["step"],
                 {"soar.json": {**tag, **turns}})
    if on_rank0(hf_behind, cfg.out, state, ("student",)):
        rloo_extras.save_hf(run.student, os.path.join(cfg.out, "student"), run.tok, state["step"],
                     {"soar.json": tag})


def student_groups(cfg, world_size: int) -> int:
    """G: --student_groups, or the most groups that divide the ranks and have a student each"""
    return cfg.student_groups or max((d for d in range(1, world_size + 1) if world_size % d == 0
                                      and d <= cfg.num_datasets * cfg.students), default=1)


def students_per_group(cfg, world_size: int) -> int:
    """the most of the g*r students one group trains in a step (round-robin over the G groups)"""
    return -(-cfg.num_datasets * cfg.students // student_groups(cfg, world_size))


def memory_per_rank(config, *, gpu_gib: float, engine_share: float, policy_ranks: list[int],
                    lora_rank: int = 0, adapters: int = 0, kl: bool = True,
                    micro_batch_tokens: int = 16384,
                    activation_checkpointing: bool = True) -> dict[str, float]:
    """GiB a rank holds on a GPU of gpu_gib (METHOD.md "Scale layout"): the engine's share (bf16
    weights and KV cache), then the trainer's: full fine-tuning, each policy (fp32 weights and
    AdamW) sharded over its policy_ranks and, with `kl`, its bf16 reference likewise, and the
    gradients of the one that trains (train_step frees them after its update); LoRA (lora_rank),
    one whole bf16 base and `adapters` fp32 adapters with AdamW, one with its gradients (twice:
    their flat copy for the all-reduce); one
    micro-batch's activations (activation_gib) and a margin for the CUDA context (CONTEXT_GIB).
    The one place this is computed: soar.py's check before anything loads, bench_rloo.py
    --memory_table and docs/scale.md."""
    n = parameter_count(config)
    est = {"engine": engine_share * gpu_gib}
    if lora_rank:
        est["base"] = 2 * n / GIB
        a = lora.adapter_parameters(config, lora_rank)
        # one adapter's gradients, and their flat copy while they are averaged over the ranks
        # (rloo._average_unsharded_gradients)
        est["adapters"] = (adapters * HELD_BYTES + 2 * GRAD_BYTES) * a / GIB
    else:
        est["policies"] = sum(HELD_BYTES * n / r for r in policy_ranks) / GIB
        est["gradients"] = max(GRAD_BYTES * n / r for r in policy_ranks) / GIB
        est["references"] = sum(2 * n / r for r in policy_ranks) / GIB if kl else 0.0
    est["activations"] = activation_gib(config, micro_batch_tokens, activation_checkpointing)
    est["context"] = CONTEXT_GIB
    est["total"] = sum(est.values())
    return est


def activation_gib(config, micro_batch_tokens: int, activation_checkpointing: bool) -> float:
    """one micro-batch's activations and transient buffers (the ACTIVATION_ parts, scaled from the
    shape they were measured at to config's): an estimate"""
    vocab, width, depth = ACTIVATION_REF
    fixed = ACTIVATION_FIXED_GIB * config.vocab_size * config.hidden_size / (vocab * width)
    head = (ACTIVATION_HEAD_GIB * min(micro_batch_tokens, rloo.LOGIT_CHUNK_TOKENS)
            * config.vocab_size / vocab)
    tokens = (ACTIVATION_TOKEN_GIB * micro_batch_tokens
              * config.hidden_size * config.num_hidden_layers / (width * depth))
    return fixed + head + tokens * (1 if activation_checkpointing else NO_CHECKPOINT_FACTOR)


def memory(cfg, world_size: int, gpu_gib: float, config) -> dict[str, float]:
    """GiB per rank of this layout on GPUs of gpu_gib (memory_per_rank): the teacher sharded
    over all ranks, a student over its group's; with LoRA the teacher's adapter and its group's
    students'"""
    G = student_groups(cfg, world_size)
    return memory_per_rank(config, gpu_gib=gpu_gib, engine_share=cfg.gpu_memory_utilization,
                           policy_ranks=[world_size, world_size // G], lora_rank=cfg.lora_rank,
                           adapters=1 + students_per_group(cfg, world_size),
                           kl=cfg.kl_coef > 0, micro_batch_tokens=cfg.micro_batch_tokens,
                           activation_checkpointing=cfg.activation_checkpointing)


def host_memory(cfg, world_size: int, config) -> float:
    """GiB of host RAM a rank holds for theta and the promotion candidates kept in a step that can
    promote (rloo_extras.snapshot: its fp32 shard of each, pinned on GPUs): one copy per student of
    its group at most (theta, and every student but the last, which stays on the GPUs); with LoRA,
    whole adapters. About g*r*4N/W bytes for full fine-tuning, whatever the groups."""
    per_group = max(students_per_group(cfg, world_size), 1)
    if cfg.lora_rank:
        params = lora.adapter_parameters(config, cfg.lora_rank)
    else:
        params = parameter_count(config) / (world_size // student_groups(cfg, world_size))
    return per_group * SNAPSHOT_BYTES * params / GIB


def host_problem(cfg, world_size: int, host_gib: float, config) -> str | None:
    """If theta and the promotion candidates (host_memory) need more than HOST_SHARE of a rank's
    part of the host's RAM (host_gib): one line with the figures and what would make it fit"""
    need = host_memory(cfg, world_size, config)
    if need <= HOST_SHARE * host_gib:
        return None
    fits = not cfg.lora_rank and host_memory(
        dataclasses.replace(cfg, lora_rank=32), world_size, config) <= HOST_SHARE * host_gib
    return (f"theta and the promotion candidates need ~{need:.0f} GiB of host RAM per rank "
            f"(host_memory), more than {HOST_SHARE:.0%} of the {host_gib:.0f} GiB a rank has: "
            + ("it fits with --lora_rank 32" if fits else
               "fewer --students or --num_datasets, more nodes, or a smaller model"))


def host_gib_per_rank() -> float:
    """this host's RAM over the ranks torchrun started on it"""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / GIB / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def memory_problem(cfg, world_size: int, gpu_gib: float, config,
                   seq_len: int) -> str | None:
    """If the layout does not fit GPUs of gpu_gib (memory): one line with its figures and the
    changes of one flag each that would make it fit (the first that fits of each flag)."""
    need = memory(cfg, world_size, gpu_gib, config)
    if need["total"] <= gpu_gib:
        return None
    G = student_groups(cfg, world_size)
    weights = 2 * parameter_count(config) / GIB   # bf16, in the engine
    others = need["total"] - need["engine"]
    share = int((gpu_gib - others) / gpu_gib * 20) / 20   # down to a multiple of 0.05
    candidates = {
        "student_groups": [d for d in range(G - 1, 0, -1) if world_size % d == 0],
        "lora_rank": [] if cfg.lora_rank else [32],
        "micro_batch_tokens": [t for t in (cfg.micro_batch_tokens // 2 ** k for k in range(1, 5))
                               if t >= seq_len],
        # the engine needs its bf16 weights and as much again for its KV cache, at least
        "gpu_memory_utilization": [share] if share * gpu_gib > 2 * weights else []}
    fixes = []
    for name, values in candidates.items():
        for v in values:
            if memory(dataclasses.replace(cfg, **{name: v}), world_size, gpu_gib,
                      config)["total"] <= gpu_gib:
                fixes.append(f"--{name} {v}")
                break
    parts = ", ".join(f"{k} {v:.1f}" for k, v in need.items() if k != "total")
    return (f"the layout needs ~{need['total']:.0f} GiB per rank of a {gpu_gib:.0f} GiB GPU "
            f"({parts}; memory_per_rank): "
            + ("it fits with " + " or ".join(fixes) if fixes else
               "no one flag makes it fit: more GPUs, or a smaller model"))


def check_settings(cfg, world_size: int, n_hard: int, seq_len: int, trains_students: bool,
                   gpu_gib: float | None = None, host_gib: float | None = None) -> list[str]:
    """What in the settings cannot work, each naming its flag (layout: METHOD.md "Scale layout");
    the least value of each count is its field's (flag). On GPUs of gpu_gib, also a layout
    that does not fit (memory_problem); with host_gib of RAM per rank, snapshots that do not
    (host_problem)."""
    students = cfg.num_datasets * cfg.students
    G = student_groups(cfg, world_size)
    checks = [
        (cfg.num_datasets < 2, f"--num_datasets {cfg.num_datasets}: RLOO over datasets "
                               "needs g >= 2"),
        (trains_students and cfg.students < 1,
         f"--students {cfg.students}: need r >= 1 per dataset"),
        (not 1 <= cfg.qr_size <= n_hard, f"--qr_size {cfg.qr_size}: each step samples "
                                         f"M={cfg.qr_size} questions from {cfg.train}, "
                                         f"which has {n_hard}"),
        (cfg.student_samples < 2, f"--student_samples {cfg.student_samples}: RLOO needs at least 2 "
                                  "per question"),
        (cfg.temperature <= 0, f"--temperature {cfg.temperature}: training needs T > 0"),
        (0 < students < G, f"--student_groups {G}: more groups than the g*r = {students} students"),
        (world_size % G, f"--student_groups {G} does not divide the {world_size} ranks"),
        (cfg.micro_batch_tokens < seq_len, f"--micro_batch_tokens {cfg.micro_batch_tokens} is less "
                                           "than one sequence (prompt + completion: "
                                           f"up to {seq_len} tokens)"),
    ]
    found = too_small(cfg) + [msg for bad, msg in checks if bad]
    if (gpu_gib or host_gib) and not found:
        config = AutoConfig.from_pretrained(cfg.model)
        problems = [memory_problem(cfg, world_size, gpu_gib, config, seq_len) if gpu_gib else None,
                    host_problem(cfg, world_size, host_gib, config) if host_gib else None]
        found += [msg for msg in problems if msg]
    return found


def open_folder(cfg, tok, world_size: int, trains_students: bool) -> tuple[list[dict], int]:
    """Lock --out (one run per folder), read the hard train split, check the settings (a folder
    made here is removed again if they cannot work). Returns the split and the engines' context."""
    made = not os.path.exists(cfg.out)
    lock_folder(cfg.out)   # a second run on the folder is refused at once
    hard = problems(cfg.train)   # one list: rank 0 drops what times out
    # a two-turn teacher's samples hold p' too (soar.two_turns)
    answer_prompt = data.answer_prompt(tok, cfg.answer_prompt) if cfg.teacher_turns == 2 else []
    seq_len = data.engine_len(tok, [q["question"] for q in hard], cfg.student_max_tokens,
                              cfg.teacher_max_tokens, answer_prompt)
    gpu = torch.cuda.is_available()
    gpu_gib = (torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
               / GIB if gpu else None)
    host_gib = host_gib_per_rank() if gpu and trains_students else None   # (CPU: RAM is all)
    bad = check_settings(cfg, world_size, len(hard), seq_len, trains_students, gpu_gib, host_gib)
    if bad:
        if made and rloo.rank0():
            shutil.rmtree(cfg.out)
        raise UsageError("these settings cannot work:\n  " + "\n  ".join(bad))
    return hard, seq_len


def load_models(cfg, device, world_size: int, tok, seq_len: int, hard: list, ckpt,
                state: dict, wb: dict) -> SoarRun:
    """The meshes, the engine, the teacher (sharded over all ranks) and this group's student, from
    the checkpoint when there is one; theta is the student's weights."""
    G = student_groups(cfg, world_size)
    mesh = init_device_mesh(device.type, (G, world_size // G), mesh_dim_names=("group", "fsdp"))
    teacher_mesh = init_device_mesh(device.type, (world_size,))
    # with LoRA a group trains all its students at once (the most students a group has)
    at_once = students_per_group(cfg, world_size) if cfg.lora_rank else 1
    seqs = step_sequences(cfg, world_size, G, at_once)
    llm = rloo.build_engine(cfg.model, seed=cfg.seed, max_model_len=seq_len, verbose=cfg.verbose,
                            gpu_memory_utilization=cfg.gpu_memory_utilization,
                            **lora.engine_args(cfg.lora_rank, at_once + 1),   # + the teacher
                            **step_engine_args(seqs, seq_len - cfg.student_max_tokens))
    if device.type == "cuda":   # (on CPU, a fixed rloo.CPU_KVCACHE_GIB)
        rloo.print0(kv_line(kv_capacity(llm), seqs, seq_len))
    teacher = load_policy(cfg, teacher_mesh, lr=cfg.teacher_lr, total_steps=cfg.outer_steps,
                          warmup_steps=cfg.teacher_warmup,
                          seed=rloo.seed_of(cfg.seed, "adapter", "teacher"))
    # with LoRA, the student's adapter goes on the teacher's base: one base per rank
    student = load_policy(cfg, mesh["fsdp"], lr=cfg.student_lr, warmup_steps=0, total_steps=1,
                          base=teacher, seed=rloo.seed_of(cfg.seed, "adapter", "student"))
    # with LoRA, the other students' adapters, on the same base (restored to theta to train)
    others = [load_policy(cfg, mesh["fsdp"], lr=cfg.student_lr, warmup_steps=0, total_steps=1,
                          base=teacher, seed=0)
              for _ in range(at_once - 1)]
    if ckpt:
        rloo_extras.load_state(teacher, os.path.join(ckpt, "teacher"))
        rloo_extras.load_state(student, os.path.join(ckpt, "student"), optimizer=False)   # theta
    if cfg.lora_rank:
        n_params = lora.base_parameters(teacher)
    else:
        n_params = sum(p.numel() for p in teacher.model.parameters())
    n_trained = sum(p.numel() for p in rloo.trainable(teacher).values())
    announce(cfg, world_size, G, n_params, n_trained, teacher.save_dtype.itemsize, bool(ckpt),
             state["step"])
    adapters = [student] + others if cfg.lora_rank else []
    return SoarRun(mesh, tok, llm, teacher, student, adapters, rloo_extras.snapshot(student), hard,
                   state, n_params, wb)


def load_policy(cfg, mesh, *, seed: int, base=None, **schedule) -> rloo.Policy:
    """A policy of cfg.model (rloo.load_policy), or with --lora_rank an adapter (drawn from `seed`)
    on the frozen base of the LoRA policy `base` (one base per rank; None: one loaded here)"""
    opts = dict(prompts=cfg.prompt_pass, activation_checkpointing=cfg.activation_checkpointing,
                kl_coef=cfg.kl_coef, **schedule)
    if not cfg.lora_rank:
        return rloo.load_policy(cfg.model, mesh, **opts)
    return lora.load_policy(cfg.model, mesh, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                            base=lora.base_of(base) if base else None, seed=seed, **opts)


# the model's size and the engine sized for a step (METHOD.md "Scale layout")
def parameter_count(config) -> int:
    """parameters of the causal LM of HF `config`, counted on the meta device: nothing is
    allocated"""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def step_engine_args(seqs: int, prompt_tokens: int) -> dict:
    """(GPU) build_engine's scheduler settings for one student step of `seqs` sequences on this
    rank, each with up to prompt_tokens of prompt: that many sequences at once (max_num_seqs;
    vLLM's default, 1024, profiles and captures for more) and a prefill batch no larger than their
    prompts (max_num_batched_tokens). On CPU, {}: build_engine sets its own."""
    if not torch.cuda.is_available():
        return {}
    seqs = max(1, seqs)
    tokens = min(ENGINE_MAX_BATCHED_TOKENS, max(ENGINE_MIN_BATCHED_TOKENS, seqs * prompt_tokens))
    return dict(max_num_seqs=seqs, max_num_batched_tokens=max(tokens, seqs))


def kv_capacity(llm) -> int:
    """tokens this rank's engine holds in its KV cache (what vLLM profiled at start)"""
    return llm.vllm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens or 0


def step_sequences(cfg, world_size: int, G: int, at_once: int) -> int:
    """the sequences one inner step puts on a rank's engine: the students its group trains at once
    (LoRA: all its students), each student_questions x student_samples rollouts, split over the
    group's ranks"""
    return -(-at_once * cfg.student_questions * cfg.student_samples // (world_size // G))


def kv_line(capacity: int, seqs: int, seq_len: int) -> str:
    """the engine's KV cache beside what one inner step needs on a rank, a warning if it is short
    (vLLM then preempts rollouts and computes them again)"""
    need = seqs * seq_len
    line = (f"engine: KV cache {capacity} tokens per rank; an inner step needs up to {need} "
            f"({seqs} rollouts x {seq_len} tokens)")
    if capacity < need:
        line += (f"; warning: {need / max(capacity, 1):.1f}x the cache, so rollouts will be "
                 "preempted and recomputed: raise --gpu_memory_utilization, or spread a student "
                 "over more ranks (fewer --student_groups)")
    return line


def announce(cfg, world_size: int, G: int, n_params: int, n_trained: int,
             save_bytes: int, resuming: bool, step: int) -> None:
    """(rank 0) the layout and what a step writes; a warning if the disk cannot hold two
    checkpoints"""
    def size(n_bytes):
        return readable(n_bytes, BYTES)
    if cfg.lora_rank:
        trained = f"LoRA rank {cfg.lora_rank} adapters of {readable(n_trained)} parameters"
        what = "adapter"
        folders = f"PEFT adapter folders {size(4 * n_trained)} each"
    else:
        trained = "full fine-tuning"
        what = "weights"
        folders = f"HF folders {size(n_params * save_bytes)} each"
    rloo.print0(f"SOAR: {world_size} ranks, {G} student groups of {world_size // G}; model "
                f"{cfg.model} ({readable(n_params)} parameters), {trained}; out {cfg.out}; "
                f"{'resuming at' if resuming else 'starting at'} step {step} of "
                f"{cfg.outer_steps}\nwritten per step: checkpoint {size(12 * n_trained)} "
                f"(the teacher's fp32 {what} + AdamW; the student's {size(4 * n_trained)} of "
                f"{what} only after a promotion), {folders} every {cfg.save_every} steps")
    free = shutil.disk_usage(cfg.out).free
    if rloo.rank0() and free < 32 * n_trained:
        print(f"soar.py: warning: {size(free)} free in {cfg.out}, less than two checkpoints "
              f"({size(32 * n_trained)}): a save may fail", file=sys.stderr)
