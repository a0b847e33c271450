"""
LoRA (METHOD.md "LoRA"): policies that are low-rank adapters on one frozen base per rank, trained,
synced, checkpointed and written in the PEFT format. An extra beside rloo.py, which knows nothing
of it: a LoRA policy is an rloo.Policy whose model is an AdapterModel (the shared base with this
policy's adapter active, its parameters the adapter's alone) and whose `backend` is this module,
so rloo's sync_weights and rloo_extras' save_state, load_state and save_hf call the functions of
the same name here. rloo.train_step and rloo_extras' snapshot, restore and broadcast_snapshot need
nothing of it.

    teacher = lora.load_policy("my/model", mesh, rank=32, lr=1e-4, warmup_steps=0, total_steps=10)
    student = lora.load_policy("my/model", mesh, rank=32, lr=1e-4, warmup_steps=0, total_steps=10,
                               base=lora.base_of(teacher))   # one base for both
    llm = rloo.build_engine("my/model", max_model_len=256, **lora.engine_args(32, adapters=2))
    lora.rl_steps([teacher, student], llm, [batch_a, batch_b], ...)   # one engine call for both

Imports: torch, safetensors (with transformers), vLLM's LoRARequest, and rloo.
"""
import json
import math
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

import rloo
import rloo_extras

# -----------------------------------------------------------------------------
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # the max_lora_rank values vLLM takes
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")   # a PEFT adapter folder
SHM = "/dev/shm"            # where adapters are written for the engine, if room (adapter_root)
# -----------------------------------------------------------------------------


class LoraLinear(torch.nn.Module):
    """A frozen linear layer plus the low-rank update of the adapter active on it:
    y = W x + (alpha / r) B A x. A and B belong to a policy (its AdapterModel), not to this module,
    so one base serves the teacher and every student, and with no adapter, the KL reference."""

    def __init__(self, base_layer: torch.nn.Linear):
        super().__init__()
        self.base_layer = base_layer
        self.active = None   # (A, B, alpha / r) of the active adapter; None: the base alone

    def forward(self, x):
        y = self.base_layer(x)
        if self.active is None:
            return y
        A, B, scale = self.active
        return y + scale * F.linear(F.linear(x, A.to(x.dtype)), B.to(x.dtype))


def lora_layers(model) -> list[tuple[str, LoraLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLinear)]


class AdapterModel(torch.nn.Module):
    """A LoRA policy's model: the shared frozen base, run with this adapter active on its
    LoraLinears (None: the base alone, the KL reference). Its parameters are the adapter's alone,
    by PEFT's names ("model.layers.0.mlp.up_proj.lora_A"). The adapter is made active at each
    forward; rloo.train_step runs the reference's forward before the policy's, so a recomputed
    layer (activation checkpointing) sees this adapter in backward."""

    def __init__(self, base, adapter: dict | None, alpha: float, base_path: str):
        super().__init__()
        self.bases = [base]      # in a list: the base is not a submodule (nor its weights ours)
        self.adapter = adapter   # {name: fp32 Parameter}, or None
        self.alpha = alpha       # the update is scaled by alpha / rank
        self.base_path = base_path   # the base model (adapter_config.json names it)
        self.layers = lora_layers(base)
        self.served = None       # the LoRARequest of its version in the engine (sync_weights)

    @property
    def lm_head(self):
        return self.bases[0].lm_head

    def named_parameters(self, *args, **kwargs):
        return iter((self.adapter or {}).items())

    def forward(self, **inputs):
        for name, m in self.layers:
            if self.adapter is None:
                m.active = None
            else:
                A = self.adapter[name + ".lora_A"]
                m.active = (A, self.adapter[name + ".lora_B"], self.alpha / A.shape[0])
        return self.bases[0](**inputs)


def base_of(policy: rloo.Policy):
    """the frozen base a LoRA policy's adapter sits on (for another policy to share it)"""
    return policy.model.bases[0]


def load_base(path: str, dev, activation_checkpointing: bool):
    """The frozen base, whole on this rank as in its engine, in the compute dtype (bf16 on GPUs:
    nothing of it is trained), with every linear layer of its decoder in a LoraLinear (the
    embeddings and the head stay as they are, as with PEFT's "all-linear")."""
    dtype = rloo.GPU_PARAM_DTYPE if dev.type == "cuda" else torch.float32
    model = rloo.load_hf(path, dtype, activation_checkpointing)
    linear = [name for name, m in model.model.layers.named_modules()
              if isinstance(m, torch.nn.Linear)]
    for name in linear:
        parent, _, leaf = name.rpartition(".")
        holder = model.model.layers.get_submodule(parent)
        setattr(holder, leaf, LoraLinear(getattr(holder, leaf)))
    model.requires_grad_(False)
    # eval mode: no dropout, so the base alone is a fixed KL reference and base + adapter the
    # function the engine samples; but HF recomputes a decoder layer's activations
    # (activation_checkpointing) only while that layer is training: its own flag alone is set
    model.eval()
    if activation_checkpointing:
        for layer in model.model.layers:
            layer.training = True
    return model.to(dev)


def new_adapter(model, rank: int, seed: int) -> dict[str, torch.nn.Parameter]:
    """A fresh fp32 adapter for every LoraLinear of model, the same on every rank (`seed`): A drawn
    as PEFT draws it (Kaiming-uniform, bound 1/sqrt(fan_in)), B = 0, so it starts as the base."""
    g = torch.Generator().manual_seed(seed)
    adapter = {}
    for name, m in lora_layers(model):
        out_features, in_features = m.base_layer.weight.shape
        bound = 1 / math.sqrt(in_features)
        A = torch.empty(rank, in_features).uniform_(-bound, bound, generator=g)
        dev = m.base_layer.weight.device
        adapter[name + ".lora_A"] = torch.nn.Parameter(A.to(dev))
        adapter[name + ".lora_B"] = torch.nn.Parameter(torch.zeros(out_features, rank, device=dev))
    return adapter


def load_policy(path: str, mesh, *, rank: int, alpha: float = 32.0, lr: float, warmup_steps: int,
                total_steps: int | None, kl_coef: float = 0.001, grad_clip: float = 1.0,
                activation_checkpointing: bool = False, prompts: str = "auto", base=None,
                seed: int = 0) -> rloo.Policy:
    """A fresh rank-`rank` adapter (drawn from `seed`) on the frozen base `base` (base_of another
    LoRA policy), or on one loaded here from `path`: only the adapter trains, and the base alone
    is the KL reference (METHOD.md "LoRA"). The other arguments are rloo.load_policy's."""
    dev = rloo.device_of(mesh)
    if base is None:
        base = load_base(path, dev, activation_checkpointing)
    model = AdapterModel(base, new_adapter(base, rank, seed), alpha, path)
    ref = AdapterModel(base, None, alpha, path) if kl_coef > 0 else None
    policy = rloo.Policy(model, ref, None, None, mesh, kl_coef, grad_clip, device=dev,
                         shared_prompts=rloo.prompt_pass(prompts, mesh.device_type),
                         backend=sys.modules[__name__])   # rloo calls this module's functions
    rloo.reset_optimizer(policy, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps)
    return policy


def adapter_parameters(config, rank: int) -> int:
    """parameters of one rank-`rank` adapter on every linear layer of the decoder of the causal LM
    of HF `config`, counted on the meta device: nothing is allocated"""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    return sum(rank * (m.in_features + m.out_features) for m in linear)


# -----------------------------------------------------------------------------
# the engine: adapters served on its base (vLLM's LoRA), a new id per version

def engine_args(rank: int, adapters: int) -> dict:
    """rloo.build_engine's arguments for an engine that also serves adapters of up to `rank`,
    `adapters` of them in one call; {} for rank 0 (no LoRA)"""
    if not rank:
        return {}
    return dict(enable_lora=True, max_loras=adapters, max_cpu_loras=adapters,
                max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= rank))


def adapter_config(policy: rloo.Policy) -> dict:
    """adapter_config.json of a PEFT LoRA folder holding policy's adapter"""
    adapter = policy.model.adapter
    A = next(iter(adapter.values()))
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM",
            "base_model_name_or_path": policy.model.base_path, "r": A.shape[0],
            "lora_alpha": policy.model.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted({name.split(".")[-2] for name in adapter}),
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "inference_mode": True}


def write_adapter(policy: rloo.Policy, path: str, dtype=torch.float32) -> None:
    """policy's adapter as a PEFT folder: what peft.PeftModel.from_pretrained and vLLM's
    LoRARequest load on the base model"""
    os.makedirs(path, exist_ok=True)
    tensors = {f"base_model.model.{name}.weight": p.detach().to("cpu", dtype).contiguous()
               for name, p in policy.model.adapter.items()}
    save_file(tensors, os.path.join(path, LORA_FILES[1]))
    with open(os.path.join(path, LORA_FILES[0]), "w", encoding="utf-8") as f:
        json.dump(adapter_config(policy), f, indent=1)


def _adapter_config(path: str) -> dict:
    """adapter_config.json of the PEFT LoRA folder `path`; {} if it is not one"""
    config = os.path.join(path, LORA_FILES[0])
    if not os.path.exists(config):
        return {}
    with open(config, encoding="utf-8") as f:
        return json.load(f)


def adapter_rank(path: str) -> int:
    """the rank of the PEFT LoRA folder `path`; 0 if it is not one"""
    return _adapter_config(path).get("r", 0)


def adapter_base(path: str) -> str:
    """the base model the PEFT LoRA folder `path` was trained on; "" if it is not one"""
    return _adapter_config(path).get("base_model_name_or_path", "")


def serve_adapter(llm: rloo.Engine, path: str):
    """The PEFT folder `path` into this rank's engine under a new id, loaded now; requests are
    served by it from then on (rloo.generate). Returns its LoRARequest. Adapters are served on the
    engine's base: full weights served or synced since are replaced by the base's first."""
    from vllm.lora.request import LoRARequest   # (see rloo.build_engine)
    if llm.base_replaced:
        rloo_extras.serve_hf(llm, llm.base_path)
    llm.adapter_ids += 1
    request = LoRARequest(f"adapter-{llm.adapter_ids}", llm.adapter_ids, path)
    llm.vllm.llm_engine.add_lora(request)
    llm.adapter = request
    return request


def sync_weights(policy: rloo.Policy, llm: rloo.Engine):
    """LoRA's weight sync (rloo.sync_weights): the policy's adapter, in the engine's dtype, as a new
    adapter of the engine. Always a new id: vLLM caches adapters by id, and new weights under an id
    it holds would be served stale, silently. The policy's previous version leaves the engine.
    Returns its LoRARequest: what serves its requests."""
    path = os.path.join(adapter_dir(llm), str(llm.adapter_ids + 1))
    write_adapter(policy, path, llm.vllm.llm_engine.model_config.dtype)
    previous = policy.model.served
    policy.model.served = serve_adapter(llm, path)
    if previous is not None:
        llm.vllm.llm_engine.remove_lora(previous.lora_int_id)
        shutil.rmtree(previous.lora_path, ignore_errors=True)
    return policy.model.served


def adapter_dir(llm: rloo.Engine) -> str:
    """where this rank writes the adapters its engine serves (made at the first sync; rloo.shutdown
    removes it): RAM-backed if there is room for each version and the next of max_loras adapters"""
    if not llm.adapter_dir:
        config = llm.vllm.llm_engine.vllm_config
        lora = config.lora_config
        n = adapter_parameters(config.model_config.hf_config, lora.max_lora_rank)
        need = 2 * lora.max_loras * n * config.model_config.dtype.itemsize
        llm.adapter_dir = tempfile.mkdtemp(prefix="rloo-adapters-", dir=adapter_root(need))
    return llm.adapter_dir


def adapter_root(need_bytes: int, shm: str = SHM) -> str | None:
    """RAM-backed `shm` where it exists and has need_bytes free, else the temporary folder (None: a
    container's /dev/shm is 64 MB by default, less than one rank-32 adapter of a 3B model)"""
    if os.path.isdir(shm) and shutil.disk_usage(shm).free >= need_bytes:
        return shm
    return None


# -----------------------------------------------------------------------------
# state and folders (rloo_extras' save_state, load_state and save_hf call these for a LoRA policy)

def save_state(policy: rloo.Policy, path: str, optimizer: bool = True) -> None:
    """The adapter (and its AdamW and schedule state), the same on every rank, in one file rank 0
    writes"""
    if rloo.rank0():
        state = {"adapter": {n: p.detach().cpu() for n, p in policy.model.adapter.items()}}
        if optimizer:
            state.update(optim=policy.optimizer.state_dict(), sched=policy.scheduler.state_dict())
        os.makedirs(path, exist_ok=True)
        torch.save(state, os.path.join(path, "adapter.pt"))
    dist.barrier()


def load_state(policy: rloo.Policy, path: str, optimizer: bool = True) -> None:
    state = torch.load(os.path.join(path, "adapter.pt"), map_location=policy.device,
                       weights_only=True)
    with torch.no_grad():
        for n, p in policy.model.adapter.items():
            p.copy_(state["adapter"][n])
    if optimizer:
        policy.optimizer.load_state_dict(state["optim"])
        policy.scheduler.load_state_dict(state["sched"])


def save_hf(policy: rloo.Policy, path: str, tokenizer=None, version: int = 0,
            extra: dict | None = None) -> None:
    """rloo_extras.save_hf's folder as a PEFT adapter folder (fp32) for the base model"""
    rloo_extras.write_folder(path, version, lambda folder: write_adapter(policy, folder), tokenizer,
                      extra)


def base_parameters(policy: rloo.Policy) -> int:
    """the frozen base's parameters (the policy's own are its adapter's)"""
    return sum(p.numel() for p in base_of(policy).parameters())


# -----------------------------------------------------------------------------
# several adapters in one engine call: each request names its policy's adapter

def requests_of(served: list, counts: list[int]) -> list | None:
    """What serves each request of a call that holds counts[b] requests of the b-th of several
    policies, from what rloo.sync_weights returned for each; None for one policy: the engine serves
    what was synced last. Several in one call must be adapters: the engine holds one set of full
    weights."""
    if len(served) == 1:
        return None
    if any(s is None for s in served):
        raise ValueError("several policies in one engine call need LoRA adapters (lora.py)")
    return [s for s, count in zip(served, counts) for _ in range(count)]


def rl_steps(policies: list, llm, batches: list[list[tuple[str, str]]], *, prompt, reward,
             samples: int, max_tokens: int, seed: int, temperature: float = 1.0, group=None,
             micro_batch_tokens: int = 16384, advantages=rloo.rloo_advantages, loss=rloo.rloo_loss,
             train_temperature: float | None = None, updates: int = 1) -> list[dict]:
    """rloo.rl_step for several adapter policies, each on its batch, all their rollouts sampled in
    one engine call (each request served by its policy's adapter; request i of the call draws
    seed + i * samples, rloo.generate), then `updates` updates each (rloo.learn). Returns, per
    policy, rloo.learn's stats."""
    if group is None:
        group = policies[0].mesh.get_group()
    with rloo.timed("sync"):
        served = [rloo.sync_weights(policy, llm) for policy in policies]
    flat, rewards = rloo.rollouts(llm, [pair for batch in batches for pair in batch], prompt=prompt,
                                  reward=reward, samples=samples, max_tokens=max_tokens, seed=seed,
                                  temperature=temperature, group=group,
                                  adapters=requests_of(served, [len(b) for b in batches]))
    if train_temperature is None:
        train_temperature = temperature
    results = []
    lo = 0
    for policy, batch in zip(policies, batches):
        hi = lo + len(batch) * samples
        results.append(rloo.learn(policy, flat[lo:hi], rewards[lo:hi], samples, group=group,
                                  advantages=advantages, loss=loss, temperature=train_temperature,
                                  micro_batch_tokens=micro_batch_tokens, updates=updates,
                                  seed=seed))
        lo = hi
    return results


def correct_counts(policies: list, llm, problems: list[dict], **count_args) -> list[list[int]]:
    """rloo.count_correct (with count_args) of each adapter policy on `problems`, all in one engine
    call. Phase: sync (the weights)."""
    with rloo.timed("sync"):
        served = [rloo.sync_weights(policy, llm) for policy in policies]
    M = len(problems)
    counts = rloo.count_correct(llm, problems * len(policies),
                                adapters=requests_of(served, [M] * len(policies)), **count_args)
    return [counts[b * M:(b + 1) * M] for b in range(len(policies))]
