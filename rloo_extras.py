"""
Beyond one policy's RLOO step (rloo.py), what the scripts need of its engine:
- a policy's weights in host RAM (snapshot, restore, broadcast_snapshot: SOAR's theta and its
  promotion candidates), sharded checkpoints (save_state, load_state) and HF folders (save_hf);
- the two-turn teacher's sampling (METHOD.md "Two-turn teacher"; soar.py --teacher_turns 2, and
  eval.py's questions of such a teacher): the question, then its answer in a second turn;
- an HF folder served as it is (serve_hf): eval.py's inference rows, and lora.py's base put back.
It imports rloo and what rloo imports, nothing else of ours: copy it beside rloo.py.
"""
import glob
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open   # (comes with transformers) serve_hf reads HF folders
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

import rloo


# -----------------------------------------------------------------------------
# a policy's weights: snapshots in host RAM, sharded state, HF folders

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """a copy of t in host memory: pinned (page-locked) for a GPU tensor, so the copies there and
    back (restore, broadcast_snapshot) run at full speed and not through pageable memory"""
    if not t.is_cuda:
        return t.to("cpu", copy=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


@torch.no_grad()
def snapshot(policy: rloo.Policy) -> dict[str, torch.Tensor]:
    """clone of this rank's local shards of the trained parameters, in host memory (students
    restart from theta in memory)"""
    rloo.reshard(policy.model)
    return {n: _host_copy(_local(p).detach()) for n, p in rloo.trainable(policy).items()}


@torch.no_grad()
def restore(policy: rloo.Policy, snap: dict[str, torch.Tensor]) -> None:
    """the policy's trained parameters := a snapshot (this rank's shards)"""
    rloo.reshard(policy.model)
    for n, p in rloo.trainable(policy).items():
        _local(p).copy_(snap[n])


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


def _state(policy: rloo.Policy, optimizer: bool) -> dict:
    rloo.reshard(policy.model)
    if optimizer:
        msd, osd = get_state_dict(policy.model, policy.optimizer)
    else:
        msd = get_model_state_dict(policy.model)
    if policy.model.lm_head.weight is policy.model.get_input_embeddings().weight:   # tied: once
        msd.pop("lm_head.weight", None)
    if optimizer:
        return {"model": msd, "optim": osd, "sched": policy.scheduler.state_dict()}
    return {"model": msd}


def finite(policy: rloo.Policy, optimizer: bool = True) -> bool:
    """are the weights (and AdamW moments) finite on every rank of the policy's mesh?"""
    tensors = list(rloo.trainable(policy).values())
    if optimizer:
        tensors += [t for st in policy.optimizer.state.values() for t in st.values() if t.dim()]
    ok = torch.stack([torch.isfinite(_local(t)).all() for t in tensors]).all().float()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=policy.mesh.get_group())
    return bool(ok.item())


def save_state(policy: rloo.Policy, path: str, optimizer: bool = True) -> None:
    """The weights and, if `optimizer`, the AdamW and schedule state, sharded (torch.distributed.
    checkpoint; all ranks of the job call; the folder must be on a filesystem all ranks see). On a
    sub-mesh (students) the groups' copies are deduplicated, so must hold the same weights (theta).
    Not atomic itself: write it into a folder that appears in one rename."""
    if policy.backend is not None:
        return policy.backend.save_state(policy, path, optimizer)
    dcp.save(_state(policy, optimizer), checkpoint_id=path)


def load_state(policy: rloo.Policy, path: str, optimizer: bool = True) -> None:
    """what save_state wrote into `path`; its weights and optimizer state must be finite"""
    if policy.backend is not None:
        policy.backend.load_state(policy, path, optimizer)
    else:
        _load_sharded_state(policy, path, optimizer)
    if not finite(policy, optimizer):
        raise RuntimeError(f"{path} holds non-finite weights or optimizer state; move its "
                           "checkpoint aside to resume from the one before")


def _load_sharded_state(policy: rloo.Policy, path: str, optimizer: bool) -> None:
    state = _state(policy, optimizer)
    dcp.load(state, checkpoint_id=path)
    opts = StateDictOptions(strict=False)   # lm_head.weight: tied, loaded as the embedding
    if optimizer:
        set_state_dict(policy.model, policy.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=opts)
        policy.scheduler.load_state_dict(state["sched"])
    else:
        set_model_state_dict(policy.model, state["model"], options=opts)


def save_hf(policy: rloo.Policy, path: str, tokenizer=None, version: int = 0,
            extra: dict | None = None) -> None:
    """Gather the full weights on rank 0 and write an HF folder that from_pretrained / vLLM load
    (safetensors, in the dtype of the checkpoint the policy started from), with `extra` json files.
    It is written as path.v<version>/, then `path`, a symbolic link, is switched to it in one
    os.replace: a reader finds the old folder or the new one, never none. All ranks call."""
    if policy.backend is not None:
        return policy.backend.save_hf(policy, path, tokenizer, version, extra)
    rloo.reshard(policy.model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(policy.model, options=options)
    state_dict = {k: v.to(policy.save_dtype) for k, v in sd.items()} if rloo.rank0() else None
    write_folder(path, version, lambda folder: policy.model.save_pretrained(
        folder, state_dict=state_dict), tokenizer, extra)


def write_folder(path: str, version: int, write_weights, tokenizer=None,
                 extra: dict | None = None) -> None:
    """save_hf's folder: write_weights(folder), the tokenizer and the `extra` json files into
    path.v<version>/, then the link `path` switched to it; rank 0 writes, all ranks call"""
    if rloo.rank0():
        target = f"{path}.v{version}"
        for d in (target + ".tmp", target):
            shutil.rmtree(d, ignore_errors=True)
        write_weights(target + ".tmp")
        if tokenizer is not None:
            tokenizer.save_pretrained(target + ".tmp")
        for name, obj in (extra or {}).items():
            with open(os.path.join(target + ".tmp", name), "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=1)
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


# -----------------------------------------------------------------------------
# the two-turn teacher's sampling, and an HF folder served as it is


def sample_turns(llm, prompt, k: int, *, answer_prompt: list[int], stop: str, turn_end,
                 max_tokens: int, temperature: float, seed: int,
                 group=None) -> tuple[list[tuple], list[str]]:
    """k two-turn samples (METHOD.md "Two-turn teacher"): turn 1 from `prompt`, ended at the first
    token where turn_end(text) (an index, or None while the turn is open) says it has ended (the
    engine stops at the string `stop`; turn_end may end it sooner), turn 2 from prompt + turn 1 +
    answer_prompt (token ids) with what turn 1 left of max_tokens; request i of turn 1 has seed + i,
    of turn 2 seed + k + i. Returns each sample's turns, (turn 1, turn 2), and its text: turns 1
    and 2 with answer_prompt between, as decoded by the engine's tokenizer; a turn 1 that did not
    end has no turn 2 and the text ""."""
    decode = llm.vllm.get_tokenizer().decode
    firsts = [_end_turn(o[0], turn_end, decode)
              for o in rloo.generate(llm, [prompt] * k, temperature=temperature,
                                     max_tokens=max_tokens, seed=seed, stop=stop, group=group)]
    closed = [i for i, s in enumerate(firsts)
              if turn_end(s.text) is not None and len(s.token_ids) < max_tokens]
    seconds = rloo.generate(llm, [list(prompt) + firsts[i].token_ids + answer_prompt
                                  for i in closed], temperature=temperature,
                            max_tokens=[max_tokens - len(firsts[i].token_ids) for i in closed],
                            seed=seed + k, group=group)
    samples = [(s,) for s in firsts]
    texts = [""] * k
    for i, out in zip(closed, seconds):
        samples[i] = (firsts[i], out[0])
        texts[i] = decode(firsts[i].token_ids + answer_prompt) + out[0].text
    return samples, texts


def turns_of(llm, prompt, *, answer_prompt: list[int], stop: str, turn_end, max_tokens: int,
             temperature: float, group=None):
    """sample_until's draw of two-turn samples: sample_turns of `prompt` with these settings"""
    return lambda k, seed: sample_turns(llm, prompt, k, answer_prompt=answer_prompt, stop=stop,
                                        turn_end=turn_end, max_tokens=max_tokens,
                                        temperature=temperature, seed=seed, group=group)


def _end_turn(sample: rloo.Sample, turn_end, decode) -> rloo.Sample:
    """sample cut after its first token whose text so far has ended (turn_end), as the engine cuts
    at a stop string: the shorter turn is as exact a sample; as it is where that is its end"""
    end = turn_end(sample.text)
    if end is None or end == len(sample.text):
        return sample
    ids = sample.token_ids
    lo, hi = 1, len(ids)   # the fewest tokens whose text has ended
    while lo < hi:
        mid = (lo + hi) // 2
        if turn_end(decode(ids[:mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    logprobs = sample.logprobs[:lo] if sample.logprobs is not None else None
    return rloo.Sample(decode(ids[:lo]), ids[:lo], sample.prompt_token_ids, logprobs)


def turns(sample) -> tuple:
    """the Samples of what sample_until kept: the one, or a two-turn sample's two"""
    return sample if isinstance(sample, tuple) else (sample,)


def serve_hf(llm, path: str) -> None:
    """The full weights of the HF folder `path` (or hub name) into this rank's engine, streamed
    from its safetensors files one tensor at a time (no trainer, no optimizer: an inference row of
    eval.py); requests are served by them from then on. The folder must hold the engine's
    architecture (a fine-tune of the model it was built from). A tied head is sent as the
    embedding: vLLM's reload_weights(weights_path=...) skips it and keeps the old head's logits
    (5.3 nats off in our tests). vLLM's reload also drops every adapter it holds
    (lora.serve_adapter loads them again)."""
    # the engine's own base (built from this name or folder): adapters can be served on it
    base = path == llm.base_path or os.path.realpath(path) == os.path.realpath(llm.base_path)
    if not os.path.isdir(path):   # a hub name: its files, downloaded once (as vLLM does)
        from transformers.utils.hub import snapshot_download   # (huggingface_hub's)
        path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights to serve")
    dtype = llm.vllm.llm_engine.model_config.dtype

    def weights():
        embedding = None
        head = False
        for file in files:
            with safe_open(file, "pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name).to(dtype)
                    head |= name == "lm_head.weight"
                    if name == "model.embed_tokens.weight":
                        embedding = t
                    yield name, t
        if not head and embedding is not None:
            yield "lm_head.weight", embedding

    rloo.reload_engine(llm, weights(), base_replaced=not base)
