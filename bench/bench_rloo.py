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

MFU counts 6*N*tokens for the policy forward+backward and 2*N*tokens for the reference
forward (N = all parameters, lm_head counted once when tied; attention FLOPs and activation
recomputation not counted), over a bf16 matmul measured in the same run (GPU) and over the
GPU's spec-sheet peak (launch.PEAK_TFLOPS).
"""
import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import launch  # noqa: E402
import rloo  # noqa: E402

SHAPES = {  # LlamaConfig fields; head_dim 64 everywhere (the CPU attention kernels want >= 32)
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=2048),
    "llama3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                    num_attention_heads=24, num_key_value_heads=8, vocab_size=128256,
                    rope_theta=500000.0),
}
DEFAULTS = {  # rollouts, prompt tokens, completion tokens, micro-batch tokens, activation ckpt
    "tiny": (64, 32, 128, 8192, False),
    "llama3b": (256, 128, 1024, 16384, True),   # soar.py's student step (8 questions x 32 samples)
}


def make_model(path, shape, dev):
    """random weights + a WordLevel tokenizer covering every id (so any sampled id decodes)"""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=1,
                      dtype="bfloat16" if dev.type == "cuda" else "float32")
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1",
                            unk_token="w2").save_pretrained(path)
    with torch.device(dev):   # init on the GPU when there is one: seconds instead of minutes
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16 if dev.type == "cuda" else torch.float32).save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def peak_mem_gib(dev):
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB -> GiB, process peak


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
    ap.add_argument("--workdir", default="/tmp/bench_rloo")
    return ap


def main():
    args = parser().parse_args()
    rollouts, plen, glen, mbt, ac = DEFAULTS[args.shape]
    rollouts, plen, glen = args.rollouts or rollouts, args.prompt_len or plen, args.gen_len or glen
    mbt, ac = args.micro_batch_tokens or mbt, ac and not args.no_activation_checkpointing

    rank, world, dev = rloo.init_distributed()
    peak_measured = matmul_tflops(dev)
    path = os.path.join(args.workdir, args.shape)
    n_params = make_model(path, args.shape, dev) if rank == 0 else 0   # printed by rank 0
    if dev.type == "cuda":
        torch.cuda.empty_cache()   # vLLM sizes its KV cache from the memory still free
    dist.barrier()
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    n_prompts = max(1, rollouts // args.samples)
    prompts = [torch.randint(2, vocab, (plen,), generator=g).tolist() for _ in range(n_prompts)]
    if args.train_only:
        llm, held = None, None
        if dev.type == "cuda":   # what the engine would take: the trainer gets the rest
            free, total = torch.cuda.mem_get_info()
            held = torch.empty(int(args.gpu_memory_utilization * total),  # noqa: F841 (kept alive)
                               dtype=torch.uint8, device=dev)
    else:
        llm = rloo.build_engine(path, max_model_len=plen + glen + 8,
                                gpu_memory_utilization=args.gpu_memory_utilization)
        # generation: every rank generates its share of the prompts, results gathered everywhere
        rloo.generate(llm, prompts[:1], n=2, max_tokens=4, seed=0)   # warm-up
        outs, t_gen = timed(lambda: rloo.generate(llm, prompts, n=args.samples, max_tokens=glen,
                                                  seed=1, group=dist.group.WORLD), dev)
        gen_tokens = sum(len(s.token_ids) for o in outs for s in o)
    mesh = init_device_mesh(dev.type, (world,))
    pol = rloo.load_policy(path, mesh, lr=1e-5, warmup_steps=0, total_steps=100, kl_coef=0.001,
                           activation_checkpointing=ac)

    # training: fixed-length completions (as many as rollouts), this rank's contiguous share
    comps = [torch.randint(2, vocab, (glen,), generator=g).tolist() for _ in range(rollouts)]
    prm = [prompts[i // args.samples % n_prompts] for i in range(rollouts)]   # by question
    adv = torch.randn(rollouts, generator=g).tolist()
    lo, hi = rloo.chunk(rollouts, rank, world)
    step = lambda: rloo.train_step(pol, prm[lo:hi], comps[lo:hi], adv[lo:hi],  # noqa: E731
                                   loss=rloo.rloo_loss, temperature=1.0, micro_batch_tokens=mbt)
    timed(step, dev)   # warm-up (allocator, optimizer state)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stats, t_train = timed(step, dev)
    mem = torch.tensor([peak_mem_gib(dev)], device=dev)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    t_sync = None if llm is None else timed(lambda: rloo.sync_weights(pol, llm), dev)[1]

    if rank == 0:
        seq_tokens = rollouts * (plen + glen)
        # the tokens through the model: each micro-batch runs its distinct prompts once
        run = sum(len(mb) * glen + len({tuple(prm[lo + i]) for i in mb}) * plen
                  for r in range(world) for lo, hi in [rloo.chunk(rollouts, r, world)]
                  for mb in rloo._micro_batches([plen + glen] * (hi - lo), mbt))
        flops = 8 * n_params * run              # 6N train + 2N reference
        achieved = flops / t_train / world / 1e12
        spec = launch.peak_flops()
        print(f"shape {args.shape}: {n_params / 1e6:.1f} M params, {world} rank(s) on "
              f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, "
              f"activation checkpointing {ac}, micro-batch {mbt} tokens")
        if llm is not None:
            print(f"generation: {len(prompts)} prompts x {args.samples} samples, "
                  f"{gen_tokens} new tokens in {t_gen:.2f} s = {gen_tokens / t_gen:,.0f} tokens/s "
                  f"({gen_tokens / t_gen / world:,.0f} per rank)")
        print(f"train step: {rollouts} rollouts x ({plen} + {glen}) tokens in {t_train:.2f} s = "
              f"{seq_tokens / t_train:,.0f} tokens/s ({stats['tokens'] / t_train:,.0f} completion "
              f"tokens/s; {run / t_train:,.0f} run, each micro-batch's distinct prompts once); "
              f"{achieved:.3g} TFLOP/s per rank (8N per token run)" +
              (f", MFU {achieved / peak_measured:.1%} of the {peak_measured:.0f} TFLOP/s bf16 "
               f"matmul measured now" if peak_measured else "") +
              (f", {achieved * 1e12 / spec:.1%} of the spec sheet's {spec / 1e12:.0f}"
               if spec else ""))
        if t_sync is not None:
            print(f"weight sync: {t_sync * 1000:.0f} ms = {t_sync / t_train:.1%} of a train step")
        total = (torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda"
                 else None)
        print(f"peak memory: {mem.item():.2f} GiB per rank " + (
            f"(torch.cuda.max_memory_allocated"
            f"{', with the engine share held back' if args.train_only else ''}; "
            f"the GPU has {total:.1f} GiB)" if total else "(process max RSS incl. engine)"))
    dist.barrier()


if __name__ == "__main__":
    main()
