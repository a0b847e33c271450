"""
RLOO machinery shared by the teacher and the students (SPEC.md): one in-process vLLM engine per
rank for sampling, an FSDP2-sharded HF model for training, exact weight sync between the two,
in-memory snapshots for "students restart from theta" and promotion, and checkpoints.

Layout (SPEC "Scale layout"): torchrun, one rank per GPU (or CPU process), TP = 1 engines built
with distributed_executor_backend="external_launcher" so each engine lives inside its rank's
process and serves whatever weights are synced into it next (teacher or student).
"""
import logging
import math
import os
import shutil
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

# -----------------------------------------------------------------------------
# engine (vLLM) settings
CPU_KVCACHE_GIB = "1"       # VLLM_CPU_KVCACHE_SPACE on CPU; the default RAM fraction fails (NOTES)
CPU_MEM_UTIL = 0.2          # on CPU gpu_memory_utilization is a fraction of RAM (0.2 verified)
# optimizer settings (SPEC Table 3 gives AdamW + lr + schedule; the rest is ours)
ADAM_BETAS = (0.9, 0.999)
WEIGHT_DECAY = 0.0          # unspecified by the paper; no decay, as usual for RL fine-tuning
ADAM_EPS = 1e-8
# training numerics
GPU_PARAM_DTYPE = torch.bfloat16   # compute dtype on GPU; master weights + grads reduce stay fp32
# -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """rank, world size, device. A plain `python script.py` becomes a 1-rank group, so the
    same code path (external_launcher engine, FSDP2) runs with and without torchrun."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo",
                                device_id=torch.device("cuda", torch.cuda.current_device()) if cuda else None)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), dev


# -----------------------------------------------------------------------------
# sampling

def build_engine(model_path: str, *, max_model_len: int, seed: int = 0,
                 gpu_memory_utilization: float = 0.3):
    """One engine per rank, built ONCE (all ranks at the same time: vLLM makes groups) and
    reused for every model the rank serves; weights change only through sync_weights."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")   # else an INFO line per weight sync
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
              max_num_batched_tokens=max(4096, max_model_len) if cpu else None)
    # the rotary cos/sin cache is not in HF checkpoints, so every reload warns that it kept the
    # engine's own copy, which is right (set after LLM(): vLLM configures its loggers there)
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    return llm


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]


def _chunk(n: int, rank: int, world: int) -> tuple[int, int]:
    """contiguous [lo, hi) share of n items for rank (the first n % world ranks get one more)"""
    q, r = divmod(n, world)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (rank < r)


def generate(llm, prompts: list, *, n: int = 1, temperature: float = 1.0, max_tokens: int,
             seed: int, group=None) -> list[list[Sample]]:
    """result[i] = the n samples of prompts[i] (a string, or a list of token ids).
    With a group the prompts are split over its ranks and every rank returns the full list.
    Request i carries seed + i (i global), so results do not depend on the split; one seed per
    request because equal (seed, prompt) pairs give equal completions (NOTES)."""
    from vllm import SamplingParams
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    lo, hi = _chunk(len(prompts), rank, world)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompts[lo:hi]]
    greedy = temperature == 0   # vLLM refuses n > 1 when greedy: sample once, repeat n times
    params = [SamplingParams(n=1 if greedy else n, temperature=temperature, max_tokens=max_tokens,
                             seed=seed + i) for i in range(lo, hi)]
    outs = llm.generate(inputs, params, use_tqdm=False) if inputs else []
    mine = [[Sample(c.text, list(c.token_ids), list(o.prompt_token_ids))
             for c in (o.outputs * n if greedy else o.outputs)] for o in outs]
    if world == 1:
        return mine
    parts = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    return [s for part in parts for s in part]


# -----------------------------------------------------------------------------
# training

@dataclass
class Policy:
    model: torch.nn.Module            # FSDP2-sharded HF causal LM (fp32 master weights)
    ref: torch.nn.Module | None       # frozen sharded copy for the KL term; None if kl_coef == 0
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    mesh: object                      # 1-D DeviceMesh sharding both models
    lr: float
    warmup_steps: int
    total_steps: int
    kl_coef: float = 0.001
    grad_clip: float = 1.0
    save_dtype: torch.dtype = torch.float32   # dtype of the checkpoint we loaded (for save_hf)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def _load_sharded(path, mesh, trainable, activation_checkpointing=False):
    from transformers import AutoModelForCausalLM
    # every rank reads the (mmapped) safetensors, then fully_shard keeps only its shard on the
    # mesh device. Trained weights stay fp32 (AdamW updates at lr 1e-5 vanish in bf16 rounding);
    # the frozen reference can be stored in the compute dtype.
    gpu = mesh.device_type == "cuda"
    dtype = torch.float32 if trainable or not gpu else GPU_PARAM_DTYPE
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
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


def reset_optimizer(policy: Policy, *, lr=None, warmup_steps=None, total_steps=None) -> None:
    """fresh AdamW state + schedule (every student inner loop starts one)"""
    policy.lr = policy.lr if lr is None else lr
    policy.warmup_steps = policy.warmup_steps if warmup_steps is None else warmup_steps
    policy.total_steps = policy.total_steps if total_steps is None else total_steps
    policy.optimizer = torch.optim.AdamW(policy.model.parameters(), lr=policy.lr, betas=ADAM_BETAS,
                                         eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
    policy.scheduler = torch.optim.lr_scheduler.LambdaLR(
        policy.optimizer, _lr_lambda(policy.warmup_steps, policy.total_steps))


def load_policy(path: str, mesh, *, lr: float, warmup_steps: int, total_steps: int,
                kl_coef: float = 0.001, ref_path: str | None = None, grad_clip: float = 1.0,
                activation_checkpointing: bool = False) -> Policy:
    from transformers import AutoConfig
    model = _load_sharded(path, mesh, True, activation_checkpointing)
    ref = _load_sharded(ref_path or path, mesh, False) if kl_coef > 0 else None
    cfg_dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    policy = Policy(model, ref, None, None, mesh, lr, warmup_steps, total_steps, kl_coef, grad_clip,
                    cfg_dtype if isinstance(cfg_dtype, torch.dtype) else torch.float32,
                    torch.device(mesh.device_type, torch.cuda.current_device())
                    if mesh.device_type == "cuda" else torch.device("cpu"))
    reset_optimizer(policy)
    return policy


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - mean_{j != i} r_j over the last dim (SPEC: raw, not normalised).
    Teacher: rewards [g] (one per dataset); student: [questions, samples]."""
    g = rewards.shape[-1]
    assert g > 1, "RLOO needs at least 2 samples per group"
    return rewards - (rewards.sum(-1, keepdim=True) - rewards) / (g - 1)


def _token_logprobs(model, ids, attn):
    """log p(ids[:, t+1] | ids[:, :t+1]) for every position, shape [B, L-1], fp32"""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    return logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - logits.logsumexp(-1)


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


def train_step(policy: Policy, prompt_ids: list[list[int]], completion_ids: list[list[int]],
               advantages: list[float], *, micro_batch_tokens: int = 16384) -> dict:
    """One on-policy RLOO update over this rank's rows of the batch (every rank of policy.mesh
    calls it with its own rows). Per completion token t of rollout i (SPEC):
        pg = -A_i * exp(logp - sg(logp))          (value -A_i, gradient -A_i * dlogp)
        kl = exp(ref - logp) - (ref - logp) - 1    (k3 estimator, >= 0)
        loss = sum_{i,t} (pg + kl_coef * kl) / (completion tokens of the GLOBAL batch)
    FSDP averages gradients over ranks, so each rank's loss is scaled by the mesh size."""
    dev, group = policy.device, policy.mesh.get_group()
    world = dist.get_world_size(group)
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    stats = torch.tensor([float(sum(len(c) for c in completion_ids)), 0.0, 0.0], dtype=torch.float64, device=dev)
    dist.all_reduce(stats[:1], group=group)
    n_tokens = stats[0].item()
    scale = world / max(n_tokens, 1.0)
    batches = _micro_batches([len(s) for s in seqs], micro_batch_tokens)
    # every rank must run as many forward/backward passes as the busiest one, or the FSDP
    # all-gathers / reduce-scatters of the others hang: pad with zero-weight dummies
    n_mb = torch.tensor([len(batches)], device=dev)
    dist.all_reduce(n_mb, op=dist.ReduceOp.MAX, group=group)
    batches += [None] * (int(n_mb.item()) - len(batches))
    for rows in batches:
        dummy = rows is None
        rows = rows or []
        L = max([len(seqs[i]) for i in rows], default=2)
        ids = torch.zeros(max(len(rows), 1), L, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros(ids.shape[0], L - 1)       # 1 on positions that predict a completion token
        adv = torch.zeros(ids.shape[0], 1)
        for b, i in enumerate(rows):
            s, P = seqs[i], len(prompt_ids[i])
            ids[b, :len(s)] = torch.tensor(s)
            attn[b, :len(s)] = 1
            mask[b, P - 1:len(s) - 1] = 1
            adv[b] = advantages[i]
        if dummy:
            attn[0] = 1
        ids, attn, mask, adv = ids.to(dev), attn.to(dev), mask.to(dev), adv.to(dev)
        logp = _token_logprobs(policy.model, ids, attn)
        pg = -adv * torch.exp(logp - logp.detach())
        if policy.ref is not None:
            with torch.no_grad():
                ref_logp = _token_logprobs(policy.ref, ids, attn)
            d = ref_logp - logp
            kl = torch.exp(d) - d - 1
        else:
            kl = torch.zeros_like(logp)
        loss = ((pg + policy.kl_coef * kl) * mask).sum() * scale
        (loss * 0.0 if dummy else loss).backward()
        stats[1] += (pg.detach() * mask).sum()
        stats[2] += (kl.detach() * mask).sum()
    dist.all_reduce(stats[1:], group=group)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), policy.grad_clip)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    lr = policy.scheduler.get_last_lr()[0]
    policy.optimizer.step()
    policy.scheduler.step()
    policy.optimizer.zero_grad(set_to_none=True)
    pg_loss, kl = stats[1].item() / max(n_tokens, 1.0), stats[2].item() / max(n_tokens, 1.0)
    return dict(loss=pg_loss + policy.kl_coef * kl, pg_loss=pg_loss, kl=kl,
                grad_norm=grad_norm.item(), lr=lr, tokens=n_tokens)


# -----------------------------------------------------------------------------
# trainer -> engine weight sync, snapshots, checkpoints

def sync_weights(policy: Policy, llm) -> None:
    """Stream the full weights into this rank's engine, one tensor at a time (a generator:
    the engine consumes it while we gather, so no full copy of the model ever exists).
    model.state_dict() has plain HF names in the same order on every rank, and includes
    lm_head.weight even when tied: leaving it out leaves the engine on stale logits (NOTES).
    Passing a generator works because external_launcher runs the worker in this process."""
    dtype = llm.llm_engine.model_config.dtype
    _reshard(policy.model)

    def weights():
        for name, p in policy.model.state_dict().items():
            # cast the shard before gathering: half the traffic when the engine runs bf16
            p = p.detach().to(dtype)
            yield name, (p.full_tensor() if isinstance(p, DTensor) else p)

    it = weights()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": it})
    for _ in it:   # drain (should be empty) so every rank runs the same all-gathers
        pass
    llm.reset_prefix_cache()


def _reshard(model):
    # FSDP2 leaves the root's parameters unsharded after a forward that has no backward
    # (e.g. a no_grad logprob pass): put every module back on its sharded DTensors first
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


def save_hf(policy: Policy, path: str, tokenizer=None) -> None:
    """gather the full weights on rank 0 and write an HF folder that from_pretrained / vLLM
    load (safetensors, in the dtype of the checkpoint the policy started from). All ranks call."""
    _reshard(policy.model)
    sd = get_model_state_dict(policy.model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    if dist.get_rank() == 0:
        sd = {k: v.to(policy.save_dtype) for k, v in sd.items()}
        policy.model.save_pretrained(path, state_dict=sd)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    dist.barrier()


def save_state(policy: Policy, path: str) -> None:
    """model + optimizer + scheduler, sharded (torch.distributed.checkpoint; all ranks of the
    job call, the folder must be on a filesystem every rank sees). For a policy on a sub-mesh
    (students) the groups' copies are deduplicated, so they must hold the same weights (theta).
    Atomic: written to path.tmp, then renamed; a kill at any point leaves either path or
    path.old intact (load_state takes either)."""
    tmp, old = path + ".tmp", path + ".old"
    if dist.get_rank() == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier()
    _reshard(policy.model)
    msd, osd = get_state_dict(policy.model, policy.optimizer)
    dcp.save({"model": msd, "optim": osd, "sched": policy.scheduler.state_dict()}, checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_state(policy: Policy, path: str) -> None:
    if not os.path.exists(path) and os.path.exists(path + ".old"):
        path = path + ".old"   # killed between the two renames of save_state
    _reshard(policy.model)
    msd, osd = get_state_dict(policy.model, policy.optimizer)
    state = {"model": msd, "optim": osd, "sched": policy.scheduler.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(policy.model, policy.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    policy.scheduler.load_state_dict(state["sched"])
