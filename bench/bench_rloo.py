"""
Benchmark of the rloo.py hot paths on whatever hardware is here: generation tokens/s (vLLM),
trainer tokens/s (one RLOO train_step), weight-sync time vs a train step, peak memory, and
model-FLOP utilisation. A random model of the chosen shape is written first (no download).

    python bench/bench_rloo.py                            # tiny Llama, CPU-sized batch
    torchrun --nproc_per_node 8 bench/bench_rloo.py --shape llama3b
        # Llama-3.2-3B shape, one student inner step: 256 rollouts x (128 + 1024) tokens
    python bench/bench_rloo.py --shape llama3b --train-only
        # the training half alone, no vLLM needed: on one GPU, with the engine's share of its memory
        # (--gpu-memory-utilization) held back, as in a real run
    python bench/bench_rloo.py --shape llama3b --train-only --profile --memory
        # and the top kernels over two micro-batches, and where the peak memory goes

    python bench/bench_rloo.py --lora_rank 8               # and LoRA beside full fine-tuning:
        # its train step, its adapter sync, and 4 adapters' rollouts in one engine call beside one
        # call per adapter (soar.py's LoRA students share a call)
    python bench/bench_rloo.py --shape llama3b --memory_table [--lora_rank 32]
        # GPU memory per rank of SOAR at the paper's settings (full fine-tuning, or LoRA), from
        # the config: launch.memory_per_rank, the arithmetic of soar.py's check before it loads

Both forward paths of token_logprobs (shared prompts, one causal pass per row: rloo.prompt_pass)
run in turn on the same batch unless --prompt_pass names one; bench/h200.sh runs the GPU checks.

MFU counts 6*N*tokens for the policy forward+backward and 2*N*tokens for the reference
forward (N = all parameters, lm_head counted once when tied; attention FLOPs and activation
recomputation not counted), over a bf16 matmul measured in the same run (GPU) and over the
GPU's spec-sheet peak (launch.PEAK_TFLOPS). With LoRA the policy is 4*N: the frozen base gets no
weight gradients (the adapters' own FLOPs, under 2% at rank 32 on 3B, are left out).
"""
import argparse
import os
import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import launch  # noqa: E402
import lora  # noqa: E402
import rloo  # noqa: E402

SHAPES = {  # LlamaConfig fields; head_dim 64 everywhere (the CPU attention kernels want >= 32)
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=2048),
    "llama3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                    num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                    rope_theta=500000.0),
    # Qwen2.5-7B's shape as a Llama (no q/k/v biases, untied head): the 7B of --memory_table
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                   num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                   rope_theta=1000000.0, tie_word_embeddings=False),
}
DEFAULTS = {  # rollouts, prompt tokens, completion tokens, micro-batch tokens, activation ckpt
    "tiny": (64, 32, 128, 8192, False),
    "llama3b": (256, 128, 1024, 16384, True),   # soar.py's student step (8 questions x 32 samples)
    "qwen7b": (256, 128, 1024, 16384, True),
}
ADAPTERS = 4   # LoRA: adapters whose rollouts share one engine call (soar.py's students of a group)

# --memory_table: SOAR at the paper's settings (METHOD.md "Hyperparameters") on one or more nodes
PAPER = dict(students=4 * 4, inner_steps=10, rollouts=256, tokens=128 + 1024, outer_steps=200)
GPUS = {"H100": 79.0, "H200": 139.0}   # GiB a rank can use
ENGINE_SHARE = 0.3     # soar.py --gpu_memory_utilization
ASSUMED_MFU = 0.4      # for the training hours of --memory_table (docs/scale.md measured 40-48%)
POPULATION = (8, 8)    # populora.py's largest reported population: teachers, students


def make_model(path, shape, dev):
    """random weights + a WordLevel tokenizer covering every id (so any sampled id decodes); a
    folder that holds the same model already is reused. Returns the parameter count."""
    cfg = LlamaConfig(**{"tie_word_embeddings": True, **SHAPES[shape]},
                      max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                      dtype="bfloat16" if dev.type == "cuda" else "float32")
    with torch.device("meta"):
        n_params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    stamp = os.path.join(path, "bench.json")
    if os.path.exists(stamp) and open(stamp).read() == cfg.to_json_string():
        return n_params
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1",
                            unk_token="w2").save_pretrained(path)
    with torch.device(dev):   # init on the GPU when there is one: seconds instead of minutes
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16 if dev.type == "cuda" else torch.float32).save_pretrained(path)
    with open(stamp, "w") as f:
        f.write(cfg.to_json_string())
    return n_params


def peak_mem_gib(dev):
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB -> GiB, process peak


def memory_table(shape: str, rank: int) -> str:
    """GPU memory per rank of SOAR at the paper's settings (PAPER), from the shape's config alone
    (launch.memory_per_rank, the arithmetic of soar.py's check), for 1 to 32 GPUs: G = the most
    groups up to g*r (launch.student_groups), each rank training ceil(g*r / G) student adapters at
    once beside the teacher's with LoRA rank `rank` (METHOD.md "LoRA"), else the teacher sharded
    over all ranks and a student over its group's (rank 0: full fine-tuning)."""
    cfg = LlamaConfig(**{"tie_word_embeddings": True, **SHAPES[shape]})
    n = launch.parameter_count(cfg)
    a = lora.adapter_parameters(cfg, rank)
    students = PAPER["students"]

    def per_rank(W, G, adapters):
        return {gpu: launch.memory_per_rank(cfg, gpu_gib=mem, engine_share=ENGINE_SHARE,
                                          policy_ranks=[W, W // G], lora_rank=rank,
                                          adapters=adapters) for gpu, mem in GPUS.items()}
    per_adapter = (launch.HELD_BYTES + launch.GRAD_BYTES) * a / launch.GIB
    what = (f"LoRA rank {rank} (an adapter {a / 1e6:.1f} M = {a / n:.1%}, {per_adapter:.2f} GiB "
            "with its gradient and AdamW)" if rank else "full fine-tuning")
    parts = [k for k in per_rank(1, 1, 1)["H100"] if k not in ("engine", "total")]
    lines = [f"SOAR with {what} on {shape} ({n / 1e9:.2f} B parameters), g*r = {students} "
             f"students of {PAPER['rollouts']} rollouts x {PAPER['tokens']} tokens, "
             f"{ENGINE_SHARE:.0%} of each GPU to vLLM; GiB per rank (launch.memory_per_rank):",
             "| GPUs | groups | students per rank | engine (bf16 weights + KV) | "
             + " | ".join(parts) + " | total H100 / H200 | fits H100 / H200 "
             "| training hours, 200 steps |",
             "|---" * (len(parts) + 7) + "|"]
    per_token = (4 if rank else 6) + 2   # the trained policy's forward + backward, the reference's
    flops = per_token * n * students * PAPER["inner_steps"] * PAPER["rollouts"] * PAPER["tokens"]
    for W in (1, 2, 4, 8, 16, 32):
        G = max(d for d in range(1, W + 1) if W % d == 0 and d <= students)
        s = -(-students // G)
        est = per_rank(W, G, 1 + s)
        fits = [("yes" if est[gpu]["total"] <= mem else "no") for gpu, mem in GPUS.items()]
        hours = flops * PAPER["outer_steps"] / W / (ASSUMED_MFU * 989e12) / 3600
        lines.append(f"| {W} | {G} | {s} | {ENGINE_SHARE:.0%} of the GPU | "
                     + " | ".join(f"{est['H100'][k]:.1f}" for k in parts)
                     + f" | {est['H100']['total']:.0f} / {est['H200']['total']:.0f} | "
                     f"{' / '.join(fits)} | {hours:.0f} |")
    lines.append(f"training hours: the students' {per_token}N FLOP per token (the policy's "
                 f"{per_token - 2}N, the KL reference's 2N) over S = {PAPER['inner_steps']}, at "
                 f"{ASSUMED_MFU:.0%} MFU of 989 TFLOP/s; generation, evaluation and the teacher "
                 "come on top. Activations: launch.activation_gib, from H200 peaks of the 3B "
                 "(docs/scale.md); context: a margin for the CUDA context and NCCL.")
    if rank:
        teachers, students = POPULATION
        est = per_rank(1, 1, teachers + students)
        lines.append(f"PopuLoRA {teachers}T-{students}S (populora.py: every rank holds every "
                     f"adapter): engine {ENGINE_SHARE:.0%} of the GPU + base "
                     f"{est['H100']['base']:.1f} + adapters {est['H100']['adapters']:.1f} + "
                     f"activations {est['H100']['activations']:.0f} = {est['H100']['total']:.0f} / "
                     f"{est['H200']['total']:.0f} GiB per rank on H100 / H200, on any number of "
                     "GPUs: ranks split the samples and replicate the adapters (the trainer's "
                     "base, sharded, is counted whole: an upper bound).")
    return "\n".join(lines)


def timed(fn, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def matmul_tflops(dev) -> float | None:
    """bf16 TFLOP/s of 8192^3 matmuls on this GPU, measured now (None on CPU)"""
    if dev.type != "cuda":
        return None
    a, b = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) for _ in range(2))
    timed(lambda: [a @ b for _ in range(3)], dev)
    _, t = timed(lambda: [a @ b for _ in range(10)], dev)
    return 10 * 2 * 8192 ** 3 / t / 1e12


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="tiny")
    ap.add_argument("--rollouts", type=int)
    # the scripts' spelling (--micro_batch_tokens), and the dashed one
    ap.add_argument("--prompt_len", "--prompt-len", type=int)
    ap.add_argument("--gen_len", "--gen-len", type=int)
    ap.add_argument("--samples", type=int, default=32, help="samples per prompt (n)")
    ap.add_argument("--micro_batch_tokens", "--micro-batch-tokens", type=int)
    ap.add_argument("--no_activation_checkpointing", "--no-activation-checkpointing",
                    action="store_true")
    ap.add_argument("--gpu_memory_utilization", "--gpu-memory-utilization", type=float,
                    default=0.3)
    ap.add_argument("--train_only", "--train-only", action="store_true",
                    help="no vLLM: the train step alone (the engine's share of GPU memory is held "
                    "back all the same)")
    ap.add_argument("--prompt_pass", "--prompt-pass", default="both",
                    choices=("both", "auto", "shared", "single"),
                    help="token_logprobs' forward path(s) to time (rloo.prompt_pass); both: each "
                    "in turn on the same batch, in one run")
    ap.add_argument("--profile", action="store_true",
                    help="also a torch.profiler table of the top kernels over two micro-batches")
    ap.add_argument("--memory", action="store_true",
                    help="also where the peak memory goes (torch.cuda.memory_stats), and a memory "
                    "snapshot of one step in --workdir (GPU)")
    ap.add_argument("--lora_rank", "--lora-rank", type=int, default=0,
                    help="also LoRA of this rank beside full fine-tuning, in the same run")
    ap.add_argument("--memory_table", "--memory-table", action="store_true",
                    help="print the memory per rank of SOAR at the paper's settings on --shape "
                    "(full fine-tuning, or LoRA of --lora_rank; from its config, nothing runs) "
                    "and exit")
    ap.add_argument("--workdir", default="/tmp/bench_rloo")
    return ap


@dataclass
class Batch:
    """the train step's rows: this rank's share of rollouts x (prompt + completion) tokens"""
    prompts: list
    completions: list
    advantages: list
    prompt_len: int
    gen_len: int
    micro_batch_tokens: int
    rollouts: int


def make_batch(args, vocab: int, rank: int, world: int) -> tuple[Batch, list]:
    """a fixed batch (seeded): `samples` rollouts per prompt, fixed-length completions; and the
    distinct prompts (for generation)"""
    rollouts, plen, glen, mbt, _ = DEFAULTS[args.shape]
    rollouts = args.rollouts or rollouts
    plen = args.prompt_len or plen
    glen = args.gen_len or glen
    mbt = args.micro_batch_tokens or mbt
    g = torch.Generator().manual_seed(0)
    n_prompts = max(1, rollouts // args.samples)
    prompts = [torch.randint(2, vocab, (plen,), generator=g).tolist() for _ in range(n_prompts)]
    comps = [torch.randint(2, vocab, (glen,), generator=g).tolist() for _ in range(rollouts)]
    prm = [prompts[i // args.samples % n_prompts] for i in range(rollouts)]   # by question
    adv = torch.randn(rollouts, generator=g).tolist()
    lo, hi = rloo.chunk(rollouts, rank, world)
    return Batch(prm[lo:hi], comps[lo:hi], adv[lo:hi], plen, glen, mbt, rollouts), prompts


def tokens_run(batch: Batch, shared: bool, world: int) -> int:
    """the tokens through the model in one step over all ranks: with shared prompts each
    micro-batch runs its distinct prompts once (every rank holds an equal share here)"""
    per_rank = 0
    for mb in rloo._micro_batches([batch.prompt_len + batch.gen_len] * len(batch.prompts),
                                  batch.micro_batch_tokens):
        distinct = len({tuple(batch.prompts[i]) for i in mb}) if shared else len(mb)
        per_rank += len(mb) * batch.gen_len + distinct * batch.prompt_len
    return per_rank * world


def train_step(pol, batch: Batch, rows: int | None = None) -> dict:
    n = rows or len(batch.prompts)
    return rloo.train_step(pol, batch.prompts[:n], batch.completions[:n], batch.advantages[:n],
                           loss=rloo.rloo_loss, temperature=1.0,
                           micro_batch_tokens=batch.micro_batch_tokens)


def time_pass(pol, batch: Batch, shared: bool, dev) -> dict:
    """one warm-up step, then one timed step with token_logprobs' `shared` path: seconds and the
    peak memory of the timed step (max over ranks)"""
    pol.shared_prompts = shared
    timed(lambda: train_step(pol, batch), dev)   # warm-up (allocator, optimizer state)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stats, seconds = timed(lambda: train_step(pol, batch), dev)
    mem = torch.tensor([peak_mem_gib(dev)], device=dev)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    return dict(stats=stats, seconds=seconds, peak_gib=mem.item())


def memory_report(pol, batch: Batch, dev, workdir: str) -> None:
    """(GPU) what the memory holds before a step (weights, reference, AdamW, the engine's share)
    and at its peak, from torch.cuda.memory_stats; a snapshot of one step for the memory viz"""
    if dev.type != "cuda":
        print("memory: --memory needs a GPU")
        return
    torch.cuda.synchronize()
    resting = torch.cuda.memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    train_step(pol, batch)
    torch.cuda.synchronize()
    path = os.path.join(workdir, f"memory-rank{dist.get_rank()}.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    st = torch.cuda.memory_stats()
    gib = {k: st[k] / 2**30 for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak",
                                      "active_bytes.large_pool.peak",
                                      "inactive_split_bytes.all.peak")}
    print(f"memory: {resting:.2f} GiB allocated between steps (weights, reference, AdamW, held "
          f"engine share); peak in a step {gib['allocated_bytes.all.peak']:.2f} GiB allocated "
          f"({gib['allocated_bytes.all.peak'] - resting:.2f} GiB above it), "
          f"{gib['reserved_bytes.all.peak']:.2f} GiB reserved, "
          f"{gib['inactive_split_bytes.all.peak']:.2f} GiB of inactive splits (fragmentation), "
          f"{st['num_alloc_retries']} allocation retries; snapshot {path} "
          "(https://pytorch.org/memory_viz)")


def profile_report(pol, batch: Batch, dev) -> None:
    """the top kernels by device time (CPU: by CPU time) over a step of two micro-batches"""
    from torch.profiler import ProfilerActivity, profile   # (only with --profile)
    rows_per_mb = max(1, batch.micro_batch_tokens // (batch.prompt_len + batch.gen_len))
    rows = min(len(batch.prompts), 2 * rows_per_mb)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        timed(lambda: train_step(pol, batch, rows), dev)
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    if dist.get_rank() == 0:
        print(f"profile: one step of {rows} rows (2 micro-batches), shared prompts "
              f"{pol.shared_prompts}, top 15 by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))


def main():
    args = parser().parse_args()
    if args.memory_table:
        return print(memory_table(args.shape, args.lora_rank))
    ac = DEFAULTS[args.shape][4] and not args.no_activation_checkpointing
    rank, world, dev = rloo.init_distributed()
    peak_measured = matmul_tflops(dev)
    path = os.path.join(args.workdir, args.shape)
    n_params = make_model(path, args.shape, dev) if rank == 0 else 0   # printed by rank 0
    if dev.type == "cuda":
        torch.cuda.empty_cache()   # vLLM sizes its KV cache from the memory still free
    dist.barrier()
    batch, prompts = make_batch(args, SHAPES[args.shape]["vocab_size"], rank, world)
    llm = None
    held = None
    gen = None
    if not args.train_only:
        llm = rloo.build_engine(path, max_model_len=batch.prompt_len + batch.gen_len + 8,
                                gpu_memory_utilization=args.gpu_memory_utilization,
                                **lora.engine_args(args.lora_rank, ADAPTERS + 1))
        gen = time_generation(llm, prompts, args.samples, batch.gen_len, dev)
    elif dev.type == "cuda":   # what the engine would take: the trainer gets the rest
        free, total = torch.cuda.mem_get_info()
        held = torch.empty(int(args.gpu_memory_utilization * total), dtype=torch.uint8,
                           device=dev)
    mesh = init_device_mesh(dev.type, (world,))
    passes = ["shared", "single"] if args.prompt_pass == "both" else [args.prompt_pass]
    opts = dict(lr=1e-5, warmup_steps=0, total_steps=100, kl_coef=0.001,
                activation_checkpointing=ac)
    results = {}   # (kind: "lora" or "full", pass) -> time_pass
    syncs = {}     # kind -> seconds of a weight sync
    adapters_line = None
    if args.lora_rank:   # first, so its peak memory holds no full fine-tuning state
        adapter = lora.load_policy(path, mesh, rank=args.lora_rank, **opts)
        for p in passes:
            results["lora", p] = time_pass(adapter, batch, rloo.prompt_pass(p, dev.type), dev)
        if llm is not None:
            syncs["lora"] = timed(lambda: rloo.sync_weights(adapter, llm), dev)[1]
            adapters_line = time_adapters(llm, adapter, prompts, args.samples, batch.gen_len, dev)
        del adapter
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    pol = rloo.load_policy(path, mesh, **opts)
    for p in passes:
        results["full", p] = time_pass(pol, batch, rloo.prompt_pass(p, dev.type), dev)
    if llm is not None:
        syncs["full"] = timed(lambda: rloo.sync_weights(pol, llm), dev)[1]
    if rank == 0:
        print(f"shape {args.shape}: {n_params / 1e6:.1f} M params, {world} rank(s) on "
              f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, "
              f"activation checkpointing {ac}, micro-batch {batch.micro_batch_tokens} tokens")
        if gen:
            print(gen)
        for (kind, p), r in results.items():
            print(train_line(kind, p, r, batch, dev, world, n_params, peak_measured))
        if dev.type == "cuda":
            for kind in sorted({kind for kind, _ in results}):
                print(estimate_line(kind, path, args, batch, world, ac, results))
        print_ratios(results, passes, dev)
        for kind, seconds in syncs.items():
            print(f"weight sync ({kind}): {seconds * 1000:.0f} ms = "
                  f"{seconds / results[kind, passes[0]]['seconds']:.1%} of a train step")
        if adapters_line:
            print(adapters_line)
    chosen = args.prompt_pass if len(passes) == 1 else "auto"   # the path memory, profile see
    pol.shared_prompts = rloo.prompt_pass(chosen, dev.type)
    if args.memory:
        memory_report(pol, batch, dev, args.workdir)
    if args.profile:
        profile_report(pol, batch, dev)
    del held   # the engine's share of GPU memory, held back until here
    dist.barrier()


def print_ratios(results: dict, passes: list, dev) -> None:
    """(rank 0) single / shared per kind of training; LoRA / full per forward path"""
    kinds = sorted({kind for kind, _ in results})
    if len(passes) == 2:
        for kind in kinds:
            ratio = results[kind, "single"]["seconds"] / results[kind, "shared"]["seconds"]
            print(f"{kind}: single / shared step time {ratio:.2f} (auto picks "
                  f"{'shared' if rloo.prompt_pass('auto', dev.type) else 'single'} on {dev.type})")
    if len(kinds) == 2:
        for p in passes:
            ratio = results["lora", p]["seconds"] / results["full", p]["seconds"]
            print(f"{p}: LoRA / full fine-tuning step time {ratio:.2f}")


def time_adapters(llm, policy, prompts: list, samples: int, gen_len: int, dev) -> str:
    """ADAPTERS distinct adapters (the policy's A, random B), each sampling every prompt: in one
    engine call with per-request adapters, and in one call per adapter with the same seeds. The
    line: both times, their ratio, and whether the tokens are the same."""
    requests = []
    for k in range(ADAPTERS):
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for name, p in policy.model.adapter.items():
                if name.endswith("lora_B"):
                    p.copy_(0.01 * torch.randn(p.shape, generator=g))
        folder = os.path.join(lora.adapter_dir(llm), f"bench-{k}")
        lora.write_adapter(policy, folder, llm.vllm.llm_engine.model_config.dtype)
        requests.append(lora.serve_adapter(llm, folder))
    kw = dict(n=samples, max_tokens=gen_len, group=dist.group.WORLD)
    rloo.generate(llm, prompts[:1], n=2, max_tokens=4, seed=0, adapters=requests[:1])   # warm-up
    one, t_one = timed(lambda: rloo.generate(llm, prompts * ADAPTERS, seed=1, **kw,
                                             adapters=[r for r in requests for _ in prompts]), dev)
    apart = []
    t_apart = 0.0
    for k, r in enumerate(requests):
        outs, seconds = timed(lambda: rloo.generate(llm, prompts, seed=1 + k * len(prompts), **kw,
                                                    adapters=[r] * len(prompts)), dev)
        apart += outs
        t_apart += seconds
    same = [s.token_ids for o in one for s in o] == [s.token_ids for o in apart for s in o]
    n = sum(len(s.token_ids) for o in one for s in o)
    return (f"LoRA rollouts: {ADAPTERS} adapters x {len(prompts)} prompts x {samples} samples "
            f"({n} tokens): one call {t_one:.2f} s, one call per adapter {t_apart:.2f} s "
            f"({t_apart / t_one:.2f}x); same tokens: {same}")


def time_generation(llm, prompts: list, samples: int, gen_len: int, dev) -> str:
    """every rank generates its share of the prompts, results gathered everywhere: the line"""
    rloo.generate(llm, prompts[:1], n=2, max_tokens=4, seed=0)   # warm-up
    outs, seconds = timed(lambda: rloo.generate(llm, prompts, n=samples, max_tokens=gen_len,
                                                seed=1, group=dist.group.WORLD), dev)
    n = sum(len(s.token_ids) for o in outs for s in o)
    world = dist.get_world_size()
    return (f"generation: {len(prompts)} prompts x {samples} samples, {n} new tokens in "
            f"{seconds:.2f} s = {n / seconds:,.0f} tokens/s ({n / seconds / world:,.0f} per rank)")


def estimate_line(kind: str, path: str, args, batch: Batch, world: int, ac: bool,
                  results: dict) -> str:
    """(GPU) launch.memory_per_rank's estimate of this run's memory per rank (what soar.py's check
    computes; the held engine share counts as the engine) beside the peaks measured"""
    gpu = torch.cuda.get_device_properties(torch.cuda.current_device())
    gpu_gib = gpu.total_memory / launch.GIB
    est = launch.memory_per_rank(AutoConfig.from_pretrained(path), gpu_gib=gpu_gib,
                               engine_share=args.gpu_memory_utilization, policy_ranks=[world],
                               lora_rank=args.lora_rank if kind == "lora" else 0, adapters=1,
                               micro_batch_tokens=batch.micro_batch_tokens,
                               activation_checkpointing=ac)
    parts = ", ".join(f"{k} {v:.1f}" for k, v in est.items() if k != "total")
    peaks = ", ".join(f"{p} {r['peak_gib']:.1f}" for (k, p), r in results.items() if k == kind)
    return (f"estimate ({kind}): {est['total']:.1f} GiB per rank ({parts}; "
            f"launch.memory_per_rank), measured peak {peaks} GiB")


def train_line(kind: str, name: str, r: dict, batch: Batch, dev, world: int, n_params: int,
               peak_measured: float | None) -> str:
    """a train step's time, throughput, MFU and peak: 8N per token run (6N train + 2N reference),
    with LoRA 6N (4N train: no weight gradients for the base)"""
    shared = name == "shared" or name == "auto" and rloo.prompt_pass("auto", dev.type)
    run = tokens_run(batch, shared, world)
    seq_tokens = batch.rollouts * (batch.prompt_len + batch.gen_len)
    per_token = 6 if kind == "lora" else 8
    achieved = per_token * n_params * run / r["seconds"] / world / 1e12
    spec = launch.peak_flops()
    label = "shared prompts" if shared else "one pass per row"
    line = (f"train step ({kind}, {name}: {label}): {batch.rollouts} rollouts x "
            f"({batch.prompt_len} + {batch.gen_len}) tokens in {r['seconds']:.2f} s = "
            f"{seq_tokens / r['seconds']:,.0f} tokens/s "
            f"({r['stats']['tokens'] / r['seconds']:,.0f} completion tokens/s; "
            f"{run:,} tokens run); {achieved:.3g} TFLOP/s per rank")
    if peak_measured:
        line += f", MFU {achieved / peak_measured:.1%} of the {peak_measured:.0f} TFLOP/s measured"
    if spec:
        line += f", {achieved * 1e12 / spec:.1%} of the spec sheet's {spec / 1e12:.0f}"
    if dev.type == "cuda":
        line += f"; peak {r['peak_gib']:.2f} GiB per rank (max_memory_allocated)"
    else:
        line += f"; peak {r['peak_gib']:.2f} GiB (process max RSS, engine included)"
    return line


if __name__ == "__main__":
    main()
