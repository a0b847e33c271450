"""
The RL engine shared by the teacher and the students, and by soar.py and eval.py: one in-process
vLLM engine per rank for sampling, an FSDP2-sharded HF model for training, exact weight sync
between the two, the RLOO loss, in-memory snapshots ("students restart from theta", promotion)
and HF folders. Checkpoints and the rest of the run plumbing are in common.py.

Layout (METHOD.md "Scale layout"): torchrun, one rank per GPU (or CPU process), TP = 1 engines
built with distributed_executor_backend="external_launcher", so each engine lives inside its
rank's process and serves whatever weights are synced into it next (teacher or student).
"""
import glob
import logging
import math
import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache, DynamicLayer

import common
import data

# -----------------------------------------------------------------------------
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
MAX_NONFINITE = 3           # updates skipped in a row (non-finite loss or gradient) that stop a run
# -----------------------------------------------------------------------------


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
    common.ENGINES.append(llm)
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
    lo, hi = common.chunk(len(prompts), rank, world)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts[lo:hi]]
    greedy = temperature == 0   # vLLM refuses n > 1 when greedy: sample once, repeat n times
    params = [SamplingParams(n=1 if greedy else n, temperature=temperature, max_tokens=max_tokens,
                             seed=seed + i) for i in range(lo, hi)]
    outs = llm.generate(inputs, params, use_tqdm=False) if inputs else []
    mine = [[Sample(c.text, list(c.token_ids), list(o.prompt_token_ids))
             for c in (o.outputs * n if greedy else o.outputs)] for o in outs]
    common.count("generated", sum(len(c.token_ids) for o in outs for c in o.outputs))
    return mine if world == 1 else [s for part in common.all_gather(mine, group) for s in part]


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
    return common.split_map(lambda pairs: data.grade([c for c, _ in pairs],
                                                     [g for _, g in pairs]),
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
                        seed=common.seed_of(seed, key, "teacher", rnd), group=group)
        samples = [o[0] for o in outs]
        pairs = common.split_map(data.parse_teacher_batch, [s.text for s in samples], group)
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
        for layer in model.model.layers:   # else HF drops the cache; ours never appends
            layer._can_checkpoint_with_cache = True
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


class _SharedPrompts(DynamicLayer):
    """One layer's keys and values of the distinct prompts (token_logprobs). update never appends,
    so an activation-checkpoint recompute sees what the forward saw: in the prompt pass it keeps
    the new ones; built with each row's prompt's, it returns them joined to the new ones."""
    def __init__(self, keys=None, values=None):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, keys is not None
        self.read_only = keys is not None

    def update(self, keys, values, *args, **kwargs):
        if self.read_only:
            return torch.cat([self.keys, keys], -2), torch.cat([self.values, values], -2)
        self.keys, self.values, self.is_initialized = keys, values, True
        return keys, values


def _pad(rows: list[list[int]], dev):
    """right-padded ids and their attention mask"""
    ids = torch.zeros(len(rows), max(1, *map(len, rows)), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        attn[b, :len(r)] = 1
    return ids.to(dev), attn.to(dev)


def token_logprobs(model, prompts: list[list[int]], completions: list[list[int]],
                   temperature: float = 1.0, dev="cpu"):
    """log p(c_t | prompt, c_<t) of every completion token, [rows, longest completion], fp32, of
    the logits / temperature (the distribution vLLM samples from at that temperature), and the
    mask of real tokens. Each distinct prompt runs once, its keys and values shared by the rows
    that continue it (METHOD.md "RLOO loss"). The full [tokens, vocab] logits never exist (3B, 16k
    tokens x 128k vocab: 8 GB in fp32, kept by autograd): the head runs on chunks of positions,
    each recomputed in backward (checkpoint), its weight read after the forward (lm_head returns
    its input): FSDP2 keeps the root's parameters gathered until backward."""
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
    step, weight = max(1, LOGIT_CHUNK_TOKENS // len(completions)), model.lm_head.weight
    return torch.cat([checkpoint(_head_logprobs, hidden[:, i:i + step], weight,
                                 c_ids[:, i:i + step], temperature, use_reentrant=False)
                      for i in range(0, hidden.shape[1], step)], 1), c_attn.float()


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


def train_step(policy: Policy, prompt_ids: list[list[int]], completion_ids: list[list[int]],
               advantages: list[float], *, loss, temperature: float,
               micro_batch_tokens: int = 16384) -> dict:
    """One update on this rank's rows of the batch (every rank of policy.mesh calls it with its
    own): `loss` (rloo_loss) of the log-probs at `temperature` (the one sampled at: on-policy),
    summed over the micro-batches, divided by the completion tokens of the GLOBAL batch and, as FSDP
    averages gradients over ranks, times the mesh size."""
    dev, group = policy.device, policy.mesh.get_group()
    world = dist.get_world_size(group)
    stats = torch.tensor([float(sum(len(c) for c in completion_ids)), 0.0, 0.0],
                         dtype=torch.float64, device=dev)
    dist.all_reduce(stats[:1], group=group)
    n_tokens = stats[0].item()
    scale = world / max(n_tokens, 1.0)
    batches = _micro_batches([len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)],
                             micro_batch_tokens)
    # pad with zero-weight dummies to the busiest rank's passes, or the FSDP collectives hang
    n_mb = torch.tensor([len(batches)], device=dev)
    dist.all_reduce(n_mb, op=dist.ReduceOp.MAX, group=group)
    batches += [[]] * (int(n_mb.item()) - len(batches))
    for rows in batches:   # a dummy ([]): one prompt token, an empty completion (mask 0)
        batch = ([prompt_ids[i] for i in rows] or [[0]], [completion_ids[i] for i in rows] or [[]])
        logp, mask = token_logprobs(policy.model, *batch, temperature, dev)
        ref_logp = None
        if policy.ref is not None:
            with torch.no_grad():
                ref_logp = token_logprobs(policy.ref, *batch, temperature, dev)[0]
            common.reshard(policy.ref)   # else its root (embeddings, head) stays gathered (0.7 GiB)
        adv = torch.tensor([[advantages[i]] for i in rows] or [[0.0]], device=dev)
        total, pg, kl = loss(logp, ref_logp, adv, mask, policy.kl_coef)
        (total * scale * (1.0 if rows else 0.0)).backward()
        stats[1] += pg
        stats[2] += kl
    dist.all_reduce(stats[1:], group=group)
    common.count("trained", sum(map(len, prompt_ids)) + sum(map(len, completion_ids)))
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
        common.count("skipped_updates")
        msg = f"non-finite loss {pg_loss}, KL {kl} or gradient norm {grad_norm.item()}"
        if policy.nonfinite >= MAX_NONFINITE:
            raise RuntimeError(f"{msg} in {policy.nonfinite} updates in a row: stopping "
                               "(see MAX_NONFINITE in rloo.py)")
        common.print0(f"rloo.train_step: {msg}: update skipped", file=sys.stderr)
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
    with common.timed("sync"):
        sync_weights(policy, llm)
    with common.timed("student_rollouts"):
        outs = generate(llm, [data.student_prompt(q) for q, _ in batch], n=samples,
                        temperature=temperature, max_tokens=max_tokens, seed=seed, group=group)
        flat = [(smp, a) for o, (_, a) in zip(outs, batch) for smp in o]
        rewards = grade([smp.text for smp, _ in flat], [a for _, a in flat], group)
    table = torch.tensor(rewards).view(len(batch), samples)
    rows = common.my_share([(smp, a) for (smp, _), a in
                            zip(flat, advantages(table).flatten().tolist())], group)
    stats = train_step(policy, [smp.prompt_token_ids for smp, _ in rows],
                       [smp.token_ids for smp, _ in rows], [a for _, a in rows], loss=loss,
                       temperature=temperature if train_temperature is None else train_temperature,
                       micro_batch_tokens=micro_batch_tokens)
    return {**stats, "reward": sum(rewards) / len(rewards),
            "nontrivial": (table.std(1) > 0).tolist(),
            "accuracy": sum(r == data.R_CORRECT for r in rewards) / len(rewards)}


# -----------------------------------------------------------------------------
# trainer -> engine weight sync, snapshots, HF folders

def sync_weights(policy: Policy, llm) -> None:
    """Stream the full weights into this rank's engine one tensor at a time (a generator, consumed
    as we gather: no full copy ever exists). model.state_dict() has plain HF names in the same order
    on every rank, and includes lm_head.weight even when tied: without it vLLM silently keeps stale
    logits (1.3 nats off in our tests). model.load_weights fails on the CPU runner; reload_weights
    works, and takes a generator as external_launcher runs the worker in this process."""
    dtype = llm.llm_engine.model_config.dtype
    common.reshard(policy.model)

    def weights():
        for name, p in policy.model.state_dict().items():
            p = p.detach().to(dtype)   # cast before gathering: half the traffic to a bf16 engine
            yield name, (p.full_tensor() if isinstance(p, DTensor) else p)

    it = weights()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": it})
    for _ in it:   # drain (should be empty) so every rank runs the same all-gathers
        pass
    llm.reset_prefix_cache()




@torch.no_grad()
def snapshot(policy: Policy) -> dict[str, torch.Tensor]:
    """clone of this rank's local shards, on CPU (students restart from theta in memory)"""
    common.reshard(policy.model)
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
            for n, p in policy.model.named_parameters()}


@torch.no_grad()
def restore(policy: Policy, snap: dict[str, torch.Tensor]) -> None:
    common.reshard(policy.model)
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
    common.reshard(policy.model)
    sd = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    if common.rank0():
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
