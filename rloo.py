"""
The RL engine shared by the teacher and the students, and by soar.py and eval.py: one in-process
vLLM engine per rank for sampling, an FSDP2-sharded HF model for training, exact weight sync
between the two, the RLOO loss, in-memory snapshots ("students restart from theta", promotion),
checkpoints, and the run plumbing both scripts share (seeds, timers, flags).

Layout (METHOD.md "Scale layout"): torchrun, one rank per GPU (or CPU process), TP = 1 engines
built with distributed_executor_backend="external_launcher", so each engine lives inside its
rank's process and serves whatever weights are synced into it next (teacher or student).
"""
import argparse
import atexit
import dataclasses
import fcntl
import glob
import inspect
import json
import logging
import math
import os
import random
import re
import shutil
import socket
import struct
import sys
import time
import warnings
import zlib
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import data

# -----------------------------------------------------------------------------
# engine (vLLM) settings
CPU_KVCACHE_GIB = "1"       # on CPU the KV cache size comes from VLLM_CPU_KVCACHE_SPACE (GiB)
CPU_MEM_UTIL = 0.2          # CPU gpu_memory_utilization (of RAM; the default, 0.92, fails to start)
ENGINES = []                # this process's engines (build_engine), shut down by clean_exit
# optimizer settings (METHOD.md "Hyperparameters" gives AdamW, lr and schedule; the rest is ours)
ADAM_BETAS = (0.9, 0.999)
WEIGHT_DECAY = 0.0          # unspecified by the paper; no decay, as usual for RL fine-tuning
ADAM_EPS = 1e-8
# training numerics
GPU_PARAM_DTYPE = torch.bfloat16   # compute dtype on GPU; master weights + grads reduce stay fp32
LOGIT_CHUNK_TOKENS = 2048   # token_logprobs runs the vocabulary head on this many tokens at a time
MAX_NONFINITE = 3           # updates skipped in a row (non-finite loss or gradient) that stop a run
KEEP_CKPTS = 2              # checkpoints kept: a damaged newest one falls back to the one before
# dense bf16 peak of one GPU, for the MFU estimate in metrics.jsonl (spec sheets, SXM parts)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}
# -----------------------------------------------------------------------------


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
# sampling

def build_engine(model_path: str, *, max_model_len: int, seed: int = 0,
                 gpu_memory_utilization: float = 0.3, verbose: bool = False, **engine_args):
    """One engine per rank, built ONCE (all ranks at the same time: vLLM makes groups) and
    reused for every model the rank serves; weights change only through sync_weights. Unless
    `verbose`, vLLM's warnings and load bars stay off the console (each silenced below)."""
    # INFO: a line per weight sync. WARNING, on every start: libtcmalloc / libiomp not preloaded,
    # "Triton is installed, but doesn't include CPU backend", set_num_threads after thread binding
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if verbose else "ERROR")
    if not verbose:   # vLLM's Triton dispatcher reads the deprecated torch.distributed.reduce_op
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated")
        # ... and its Triton check warns before vLLM's log level applies
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    from vllm import LLM
    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    rank = dist.get_rank() if dist.is_initialized() else 0
    llm = LLM(model=model_path, max_model_len=max_model_len, seed=seed + rank,
              # fp32 on CPU makes synced weights bit-equal to the trainer's (tests compare
              # logprobs); bf16 on GPU is what the trainer computes in anyway
              dtype="float32" if cpu else "bfloat16",
              gpu_memory_utilization=CPU_MEM_UTIL if cpu else gpu_memory_utilization,
              distributed_executor_backend="external_launcher", tensor_parallel_size=1,
              # CPU: skip the inductor compile (minutes-scale warmup on few cores, tiny models)
              enforce_eager=cpu, enable_prefix_caching=True,
              # CPU: a chunked prefill of a seeded request crashes vLLM 0.32's CPU runner
              # ("CPU Generator does not use offset"); batches past 4096 prompt tokens chunk
              enable_chunked_prefill=not cpu,
              max_num_batched_tokens=max(4096, max_model_len) if cpu else None,
              use_tqdm_on_load=verbose, **engine_args)   # "Loading safetensors checkpoint shards"
    # the rotary cos/sin cache is not in HF checkpoints, so every reload warns that it kept the
    # engine's own copy, which is right (set after LLM(): vLLM configures its loggers there)
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    ENGINES.append(llm)
    return llm


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]


def generate(llm, prompts: list, *, n: int = 1, temperature: float = 1.0, max_tokens: int,
             seed: int, group=None) -> list[list[Sample]]:
    """result[i] = the n samples of prompts[i] (a string or token ids); with a group, prompts are
    split over its ranks and every rank returns the full list. Request i has seed + i (i global):
    results do not depend on the split, and repeated prompts get distinct seeds."""
    from vllm import SamplingParams
    rank, world = ((dist.get_rank(group), dist.get_world_size(group)) if group is not None
                   else (0, 1))
    lo, hi = chunk(len(prompts), rank, world)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts[lo:hi]]
    greedy = temperature == 0   # vLLM refuses n > 1 when greedy: sample once, repeat n times
    params = [SamplingParams(n=1 if greedy else n, temperature=temperature, max_tokens=max_tokens,
                             seed=seed + i) for i in range(lo, hi)]
    outs = llm.generate(inputs, params, use_tqdm=False) if inputs else []
    mine = [[Sample(c.text, list(c.token_ids), list(o.prompt_token_ids))
             for c in (o.outputs * n if greedy else o.outputs)] for o in outs]
    count("generated", sum(len(c.token_ids) for o in outs for c in o.outputs))
    return mine if world == 1 else [s for part in all_gather(mine, group) for s in part]


def tokenizer(model: str):
    """the tokenizer of --model, or a one-line error if it is neither an HF folder nor a hub id
    that can be reached"""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"--model {model}: neither an HF model folder nor a hub id this machine "
                           f"can reach ({data.first_line(e)})") from None


def engine_len(tok, questions: list[str], student_max_tokens: int,
               teacher_max_tokens: int = 0) -> int:
    """The engines' context: the student prompt around the longest question (a teacher sample may
    be one) plus a completion, or the teacher prompt plus a teacher sample; 16 tokens of slack."""
    longest = max([len(tok(q).input_ids) for q in questions] + [teacher_max_tokens])
    student = len(tok(data.student_prompt("")).input_ids) + longest + student_max_tokens
    teacher = len(data.teacher_prompt(tok)) + teacher_max_tokens if teacher_max_tokens else 0
    return max(student, teacher) + 16


# -----------------------------------------------------------------------------
# sampling + grading: all ranks of `group` call these, share out the work and get all results

def grade(completions: list[str], golds: list[str], group=None) -> list[float]:
    """data.grade (METHOD.md "Rewards"), split over the ranks of group"""
    return split_map(lambda pairs: data.grade([c for c, _ in pairs], [g for _, g in pairs]),
                     list(zip(completions, golds)), group)


def correct_counts(llm, problems: list[dict], *, n: int, max_tokens: int, seed: int,
                   temperature: float = 1.0, group=None, chunk_prompts: int = 0,
                   progress: bool = False) -> list[int]:
    """How many of n samples (student prompt) are correct (the 120 case) per problem: greedy
    accuracy (n = 1, temperature 0), learnability, pass@k and fail@k all count this way. Sampled in
    chunks of prompts so 5000 x 128 samples never sit in memory at once; request i carries seed + i
    whatever the chunking (generate), so results do not depend on it."""
    from tqdm import tqdm
    step = chunk_prompts or max(1, 8192 // n)
    counts = []
    for lo in tqdm(range(0, len(problems), step), disable=not progress, desc="sampling",
                   dynamic_ncols=True):
        part = problems[lo:lo + step]
        outs = generate(llm, [data.student_prompt(p["question"]) for p in part], n=n,
                        temperature=temperature, max_tokens=max_tokens, seed=seed + lo, group=group)
        rewards = grade([s.text for o in outs for s in o],
                        [p["answer"] for p in part for _ in range(n)], group)
        counts += [sum(r == data.R_CORRECT for r in rewards[i * n:(i + 1) * n])
                   for i in range(len(part))]
    return counts


def sample_teacher(llm, prompt, *, need: int, max_tokens: int, temperature: float, seed: int, key,
                   max_rounds: int, group=None) -> tuple[list, int]:
    """Rejection sampling (METHOD.md "Algorithm 1", step 1) from the weights in the engine: sample,
    keep what passes the format filter, sample again for the shortfall; exact for RLOO (METHOD.md
    "Teacher update"). Round i draws seeds from seed_of(seed, key, "teacher", i). Returns the first
    `need` valid (Sample, (question, answer)) in sampling order and the number of samples drawn."""
    kept, sampled = [], 0
    for rnd in range(max_rounds):
        todo = need - len(kept)
        # oversample by the valid rate seen so far (at least 1x, at most 8x)
        k = todo if not kept else min(8 * todo, int(todo * sampled / len(kept) * 1.2) + 1)
        outs = generate(llm, [prompt] * k, temperature=temperature, max_tokens=max_tokens,
                        seed=seed_of(seed, key, "teacher", rnd), group=group)
        samples = [o[0] for o in outs]
        pairs = split_map(data.parse_teacher_batch, [s.text for s in samples], group)
        sampled += k
        kept += [(s, p) for s, p in zip(samples, pairs) if p is not None]
        if len(kept) >= need:
            return kept[:need], sampled
    raise RuntimeError(f"the teacher produced only {len(kept)} valid question-answer pairs in "
                       f"{sampled} samples ({max_rounds} rounds) at step {key}, {need} needed: "
                       "it no longer follows the format of data.TEACHER_PROMPT "
                       "(raise --max_rejection_rounds or check the model)")


# -----------------------------------------------------------------------------
# training

@dataclass
class Policy:
    model: torch.nn.Module            # FSDP2-sharded HF causal LM (fp32 master weights)
    ref: torch.nn.Module | None       # frozen sharded copy for the KL term; None if kl_coef == 0
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    mesh: object                      # 1-D DeviceMesh sharding both models
    kl_coef: float = 0.001
    grad_clip: float = 1.0
    save_dtype: torch.dtype = torch.float32   # dtype of the checkpoint we loaded (for save_hf)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    nonfinite: int = 0                        # updates skipped in a row (non-finite loss or grad)


def _load_sharded(path, mesh, trainable, activation_checkpointing=False):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()   # else a bar per load and per save_hf, in every log
    # each rank reads the (mmapped) safetensors, fully_shard keeps its shard on the mesh device;
    # trained weights stay fp32 (AdamW steps at lr 1e-5 vanish in bf16), the frozen ref may be bf16.
    gpu = mesh.device_type == "cuda"
    dtype = torch.float32 if trainable or not gpu else GPU_PARAM_DTYPE
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    # token_logprobs applies the head in chunks, so here it copies its input (FSDP2 warns on a view)
    if (not isinstance(model.lm_head, torch.nn.Linear)
            or getattr(model.config, "final_logit_softcapping", None)):
        raise ValueError(f"{path}: token_logprobs needs a plain linear vocabulary head "
                         "(Llama, Qwen, Mistral, ...)")
    model.lm_head.forward = lambda hidden: hidden.clone()
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=GPU_PARAM_DTYPE if gpu else torch.float32,
                              reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def _lr_lambda(warmup: int, total: int):
    # linear warmup (step 0 already gets 1/warmup of the lr) then cosine decay to 0 at total
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return f


def reset_optimizer(policy: Policy, *, lr: float, warmup_steps: int, total_steps: int) -> None:
    """fresh AdamW state + schedule (every student inner loop starts one)"""
    policy.optimizer = torch.optim.AdamW(policy.model.parameters(), lr=lr, betas=ADAM_BETAS,
                                         eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
    policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer,
                                                         _lr_lambda(warmup_steps, total_steps))


def load_policy(path: str, mesh, *, lr: float, warmup_steps: int, total_steps: int,
                kl_coef: float = 0.001, grad_clip: float = 1.0,
                activation_checkpointing: bool = False) -> Policy:
    """The model in HF folder `path`, sharded over mesh, with AdamW and, if kl_coef > 0, a frozen
    copy of it as the KL reference (METHOD.md "Hyperparameters": KL to the start model)."""
    from transformers import AutoConfig
    model = _load_sharded(path, mesh, True, activation_checkpointing)
    ref = _load_sharded(path, mesh, False) if kl_coef > 0 else None
    cfg_dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    policy = Policy(model, ref, None, None, mesh, kl_coef, grad_clip,
                    cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.float32,
                    torch.device(mesh.device_type, torch.cuda.current_device())
                    if mesh.device_type == "cuda" else torch.device("cpu"))
    reset_optimizer(policy, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps)
    return policy


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j over the last dim (METHOD.md "RLOO loss": raw, not normalised).
    Teacher: rewards [g] (one per dataset); student: [questions, samples]."""
    g = rewards.shape[-1]
    assert g > 1, "RLOO needs at least 2 samples per group"
    return rewards - (rewards.sum(-1, keepdim=True) - rewards) / (g - 1)


def _head_logprobs(hidden, weight, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature
    return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)


def token_logprobs(model, ids, attn, temperature: float = 1.0):
    """log p(ids[:, t+1] | ids[:, :t+1]) for all t, [B, L-1], fp32, of the logits / temperature
    (the distribution vLLM samples from at that temperature). The full [tokens, vocab] logits
    never exist (3B, 16k tokens x 128k vocab: 8 GB in fp32, kept by autograd): the head runs on
    chunks of positions, each recomputed in backward (checkpoint), its weight read after the forward
    (lm_head returns its input): FSDP2 keeps the root's parameters gathered until backward."""
    hidden = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    step, weight = max(1, LOGIT_CHUNK_TOKENS // ids.shape[0]), model.lm_head.weight
    return torch.cat([checkpoint(_head_logprobs, hidden[:, i:i + step], weight,
                                 ids[:, i + 1:i + 1 + step], temperature, use_reentrant=False)
                      for i in range(0, hidden.shape[1], step)], 1)


def _micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """group row indices (longest first) so rows * max_len <= budget tokens per micro-batch"""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def rloo_loss(logp, ref_logp, adv, mask, kl_coef: float):
    """The loss of both the teacher and the students (METHOD.md "RLOO loss"), per completion token t
    of rollout i (mask: 1 on the positions that predict a completion token):
        pg = -A_i * exp(logp - sg(logp))          (value -A_i, gradient -A_i * dlogp)
        kl = exp(ref - logp) - (ref - logp) - 1    (k3 estimator, >= 0; 0 without a reference)
    Returns the masked sums of pg + kl_coef * kl (to backpropagate), of pg and of kl (detached)."""
    pg = -adv * torch.exp(logp - logp.detach())
    d = ref_logp - logp if ref_logp is not None else torch.zeros_like(logp)
    kl = torch.exp(d) - d - 1
    return (((pg + kl_coef * kl) * mask).sum(), (pg.detach() * mask).sum(),
            (kl.detach() * mask).sum())


def sept_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """SePT (METHOD.md "SePT"): advantage 1 for every sample whatever its reward, so rloo_loss
    without KL is the NLL of the samples themselves."""
    return torch.ones_like(rewards)


def _collate(seqs, prompt_lens, advantages, rows, dev):
    """ids, attention mask, completion mask and advantages of one micro-batch, right-padded; rows
    None: a one-row dummy (attending to its padding, advantage 0) for a rank with fewer passes"""
    L = max([len(seqs[i]) for i in rows or []], default=2)
    ids = torch.zeros(max(len(rows or []), 1), L, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(ids.shape[0], L - 1)       # 1 on positions that predict a completion token
    adv = torch.zeros(ids.shape[0], 1)
    for b, i in enumerate(rows or []):
        s, P = seqs[i], prompt_lens[i]
        ids[b, :len(s)] = torch.tensor(s)
        attn[b, :len(s)] = 1
        mask[b, P - 1:len(s) - 1] = 1
        adv[b] = advantages[i]
    if rows is None:
        attn[0] = 1
    return ids.to(dev), attn.to(dev), mask.to(dev), adv.to(dev)


def train_step(policy: Policy, prompt_ids: list[list[int]], completion_ids: list[list[int]],
               advantages: list[float], *, loss, temperature: float,
               micro_batch_tokens: int = 16384) -> dict:
    """One update on this rank's rows of the batch (every rank of policy.mesh calls it with its
    own): `loss` (rloo_loss) of the log-probs at `temperature` (the one sampled at: on-policy),
    summed over the micro-batches, divided by the completion tokens of the GLOBAL batch and, as FSDP
    averages gradients over ranks, times the mesh size."""
    dev, group = policy.device, policy.mesh.get_group()
    world = dist.get_world_size(group)
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    stats = torch.tensor([float(sum(len(c) for c in completion_ids)), 0.0, 0.0],
                         dtype=torch.float64, device=dev)
    dist.all_reduce(stats[:1], group=group)
    n_tokens = stats[0].item()
    scale = world / max(n_tokens, 1.0)
    batches = _micro_batches([len(s) for s in seqs], micro_batch_tokens)
    # pad with zero-weight dummies to the busiest rank's passes, or the FSDP collectives hang
    n_mb = torch.tensor([len(batches)], device=dev)
    dist.all_reduce(n_mb, op=dist.ReduceOp.MAX, group=group)
    batches += [None] * (int(n_mb.item()) - len(batches))
    prompt_lens = [len(p) for p in prompt_ids]
    for rows in batches:
        ids, attn, mask, adv = _collate(seqs, prompt_lens, advantages, rows, dev)
        logp = token_logprobs(policy.model, ids, attn, temperature)
        ref_logp = None
        if policy.ref is not None:
            with torch.no_grad():
                ref_logp = token_logprobs(policy.ref, ids, attn, temperature)
            _reshard(policy.ref)   # else its root (embeddings, head) stays gathered: 0.7 GiB at 3B
        total, pg, kl = loss(logp, ref_logp, adv, mask, policy.kl_coef)
        (total * scale * (0.0 if rows is None else 1.0)).backward()
        stats[1] += pg
        stats[2] += kl
    dist.all_reduce(stats[1:], group=group)
    count("trained", sum(map(len, seqs)))
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), policy.grad_clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    lr = policy.scheduler.get_last_lr()[0]
    pg_loss, kl = stats[1].item() / max(n_tokens, 1.0), stats[2].item() / max(n_tokens, 1.0)
    finite = all(map(math.isfinite, (pg_loss, kl, grad_norm.item())))   # all-reduced: ranks agree
    if finite:
        policy.optimizer.step()
        policy.scheduler.step()
    policy.optimizer.zero_grad(set_to_none=True)
    policy.nonfinite = 0 if finite else policy.nonfinite + 1
    if not finite:
        count("skipped_updates")
        msg = f"non-finite loss {pg_loss}, KL {kl} or gradient norm {grad_norm.item()}"
        if policy.nonfinite >= MAX_NONFINITE:
            raise RuntimeError(f"{msg} in {policy.nonfinite} updates in a row: stopping "
                               "(see MAX_NONFINITE in rloo.py)")
        print0(f"rloo.train_step: {msg}: update skipped", file=sys.stderr)
    return dict(loss=pg_loss + policy.kl_coef * kl, pg_loss=pg_loss, kl=kl,
                grad_norm=grad_norm.item(), lr=lr, tokens=n_tokens, skipped=not finite)


def student_step(policy: Policy, llm, batch: list[tuple[str, str]], *, samples: int,
                 temperature: float, max_tokens: int, seed: int, group, micro_batch_tokens: int,
                 advantages, loss, train_temperature: float | None = None) -> dict:
    """One student step on (question, answer) pairs (METHOD.md "Inner loop"; also eval.py's fresh
    students): sync, sample `samples` per question on the group's engines, grade (METHOD.md
    "Rewards"), `advantages` of each question's [samples] rewards (rloo_advantages: leave-one-out;
    sept_advantages: all 1), one `loss` update at train_temperature (default: the sampling one).
    `nontrivial`: per question, did its rewards vary."""
    with timed("sync"):
        sync_weights(policy, llm)
    with timed("student_rollouts"):
        outs = generate(llm, [data.student_prompt(q) for q, _ in batch], n=samples,
                        temperature=temperature, max_tokens=max_tokens, seed=seed, group=group)
        flat = [(smp, a) for o, (_, a) in zip(outs, batch) for smp in o]
        rewards = grade([smp.text for smp, _ in flat], [a for _, a in flat], group)
    table = torch.tensor(rewards).view(len(batch), samples)
    rows = my_share([(smp, a) for (smp, _), a in zip(flat, advantages(table).flatten().tolist())],
                    group)
    stats = train_step(policy, [smp.prompt_token_ids for smp, _ in rows],
                       [smp.token_ids for smp, _ in rows], [a for _, a in rows], loss=loss,
                       temperature=temperature if train_temperature is None else train_temperature,
                       micro_batch_tokens=micro_batch_tokens)
    return {**stats, "reward": sum(rewards) / len(rewards),
            "nontrivial": (table.std(1) > 0).tolist(),
            "accuracy": sum(r == data.R_CORRECT for r in rewards) / len(rewards)}


# -----------------------------------------------------------------------------
# trainer -> engine weight sync, snapshots, checkpoints

def sync_weights(policy: Policy, llm) -> None:
    """Stream the full weights into this rank's engine one tensor at a time (a generator, consumed
    as we gather: no full copy ever exists). model.state_dict() has plain HF names in the same order
    on every rank, and includes lm_head.weight even when tied: without it vLLM silently keeps stale
    logits (1.3 nats off in our tests). model.load_weights fails on the CPU runner; reload_weights
    works, and takes a generator as external_launcher runs the worker in this process."""
    dtype = llm.llm_engine.model_config.dtype
    _reshard(policy.model)

    def weights():
        for name, p in policy.model.state_dict().items():
            p = p.detach().to(dtype)   # cast before gathering: half the traffic to a bf16 engine
            yield name, (p.full_tensor() if isinstance(p, DTensor) else p)

    it = weights()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": it})
    for _ in it:   # drain (should be empty) so every rank runs the same all-gathers
        pass
    llm.reset_prefix_cache()


def _reshard(model):
    # FSDP2 leaves the root unsharded after a forward with no backward (e.g. no_grad): reshard all
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@torch.no_grad()
def snapshot(policy: Policy) -> dict[str, torch.Tensor]:
    """clone of this rank's local shards, on CPU (students restart from theta in memory)"""
    _reshard(policy.model)
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
            for n, p in policy.model.named_parameters()}


@torch.no_grad()
def restore(policy: Policy, snap: dict[str, torch.Tensor]) -> None:
    _reshard(policy.model)
    for n, p in policy.model.named_parameters():
        (p.to_local() if isinstance(p, DTensor) else p).copy_(snap[n])


@torch.no_grad()
def broadcast_snapshot(snap: dict[str, torch.Tensor], src: int, group) -> None:
    """in place, from group-rank src: promotion copies the chosen student's shards to the ranks
    with the same fsdp coordinate in every other student group (same shard shapes there)"""
    nccl = dist.get_backend(group) == "nccl"
    for t in snap.values():
        buf = t.cuda() if nccl else t
        dist.broadcast(buf, group=group, group_src=src)
        if nccl:
            t.copy_(buf)


def save_hf(policy: Policy, path: str, tokenizer=None, version: int = 0,
            extra: dict | None = None) -> None:
    """Gather the full weights on rank 0 and write an HF folder that from_pretrained / vLLM load
    (safetensors, in the dtype of the checkpoint the policy started from), with `extra` json files.
    It is written as path.v<version>/, then `path`, a symbolic link, is switched to it in one
    os.replace: a reader finds the old folder or the new one, never none. All ranks call."""
    _reshard(policy.model)
    sd = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    if rank0():
        target = f"{path}.v{version}"
        for d in (target + ".tmp", target):
            shutil.rmtree(d, ignore_errors=True)
        policy.model.save_pretrained(target + ".tmp",
                                     state_dict={k: v.to(policy.save_dtype) for k, v in sd.items()})
        if tokenizer is not None:
            tokenizer.save_pretrained(target + ".tmp")
        for name, obj in (extra or {}).items():
            data.write_json(os.path.join(target + ".tmp", name), obj)
        os.rename(target + ".tmp", target)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)   # a plain folder, as earlier versions wrote
        if os.path.lexists(path + ".link"):
            os.remove(path + ".link")
        os.symlink(os.path.basename(target), path + ".link")
        os.replace(path + ".link", path)
        for old in glob.glob(glob.escape(path) + ".v*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


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


def _state(policy: Policy, optimizer: bool) -> dict:
    _reshard(policy.model)
    msd, osd = (get_state_dict(policy.model, policy.optimizer) if optimizer
                else (get_model_state_dict(policy.model), None))
    if policy.model.lm_head.weight is policy.model.get_input_embeddings().weight:   # tied: once
        msd.pop("lm_head.weight", None)
    return {"model": msd, "optim": osd, "sched": policy.scheduler.state_dict()} if optimizer \
        else {"model": msd}


def finite(policy: Policy, optimizer: bool = True) -> bool:
    """are the weights (and AdamW moments) finite on every rank of the policy's mesh?"""
    ts = list(policy.model.parameters()) + ([t for st in policy.optimizer.state.values()
                                             for t in st.values() if t.dim()] if optimizer else [])
    ok = torch.stack([torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all()
                      for t in ts]).all().float()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=policy.mesh.get_group())
    return bool(ok.item())


def save_state(policy: Policy, path: str, optimizer: bool = True) -> None:
    """The weights and, if `optimizer`, the AdamW and schedule state, sharded (torch.distributed.
    checkpoint; all ranks of the job call; the folder must be on a filesystem all ranks see). On a
    sub-mesh (students) the groups' copies are deduplicated, so must hold the same weights (theta).
    Not atomic itself: save_checkpoint writes it in a folder that appears in one rename."""
    dcp.save(_state(policy, optimizer), checkpoint_id=path)


def load_state(policy: Policy, path: str, optimizer: bool = True) -> None:
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


# out/ckpt/step-N holds all a restart needs: save_state per policy, the run's jsonl rows up to step
# N (rows/), and state.json, which lists every file's size and CRC-32 (resume checks them); it is
# made as step-N.tmp and appears in one rename

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


# -----------------------------------------------------------------------------
# run plumbing: seeds, timers, flags

def rank0() -> bool:
    """Does this rank print and write the run's shared files? (before init: torchrun's RANK)"""
    return dist.get_rank() == 0 if dist.is_initialized() else os.environ.get("RANK", "0") == "0"


BYTES = ((1e9, "GB"), (1e6, "MB"))   # readable()'s units for sizes


def readable(x: float, units=((1e9, "B"), (1e6, "M"))) -> str:
    """x in the largest of `units` it reaches (else the last), to 3 digits: 0.6 M, 3.21 B"""
    scale, name = next((u for u in units if x >= u[0]), units[-1])
    return f"{x / scale:.3g} {name}"


def print0(*args, **kwargs) -> None:
    if rank0():
        print(*args, **{"flush": True, **kwargs})


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
