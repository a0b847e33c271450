"""
Worker for tests/test_rloo.py: run as `python tests/rloo_dist_worker.py OUT BASE REF` (1 rank, no
torchrun) or under `torchrun --nproc_per_node 2`. Exercises the real vLLM CPU engine and real
FSDP2 (gloo) and writes what it measured to OUT/rank{r}.pt; the test makes the assertions.
Also provides make_tiny_model(), used by the test to build the tiny Llama + tokenizer.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = ["What is 2 + 3?", "hello world", "Compute the sum", "The answer is", "17 and 25",
           "boxed", "What"]          # 7: an uneven split over 2 ranks
TARGET = 80                          # learning check: reward = share of completion tokens < TARGET


# shaped like Llama 3's chat template: it opens with its BOS and prints today's date unless told one
CHAT_TEMPLATE = ("{{ bos_token }}{% if date_string is not defined %}"
                 "{% set date_string = strftime_now('%d %b %Y') %}{% endif %}Today Date: "
                 "{{ date_string }}\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def train_step(*args, **kwargs):
    """rloo.train_step with the loss of the teacher and the students"""
    import rloo
    return rloo.train_step(*args, loss=rloo.rloo_loss, temperature=1.0, **kwargs)


def make_tiny_model(path: str, seed: int = 0, vocab: int = 320):
    """random 2-layer Llama (hidden 128, head_dim 64: CPU kernels reject 16) + byte-level BPE that,
    like Llama 3's, adds a BOS to the text it encodes, and a chat template that starts with one"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(PROMPTS * 10 + ["The answer is \\boxed{42}."] * 10, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
                      initializer_range=0.1)
    LlamaForCausalLM(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    return fast


def fixed_batch(n=8, seed=0, vocab=320):
    g = torch.Generator().manual_seed(seed)
    prompts = [p for p in (torch.randint(2, vocab, (int(torch.randint(3, 7, (1,), generator=g)),),
                                         generator=g).tolist() for _ in range(n // 4))
               for _ in range(4)]   # a question's 4 samples share its prompt (token_logprobs)
    comps = [torch.randint(2, vocab, (int(torch.randint(2, 10, (1,), generator=g)),),
                           generator=g).tolist() for _ in range(n)]
    rewards = torch.rand(n // 4, 4, generator=g)
    return prompts, comps, rewards


def full_weights(model):
    # all ranks must call (full_tensor is a collective)
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def hand_reference(base, ref, prompts, comps, adv, kl_coef, lr, grad_clip):
    """the loss of METHOD.md "RLOO loss" written out with plain (unsharded) HF models, one row at
    a time"""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    refm = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    T = sum(len(c) for c in comps)
    value, total = 0.0, 0.0
    for p, c, a in zip(prompts, comps, adv):
        ids = torch.tensor([p + c])
        sl = slice(len(p) - 1, len(p) + len(c) - 1)     # logits positions that predict c
        logp = torch.log_softmax(model(ids).logits[0, sl], -1)[torch.arange(len(c)), c]
        with torch.no_grad():
            rlogp = torch.log_softmax(refm(ids).logits[0, sl], -1)[torch.arange(len(c)), c]
        k3 = torch.exp(rlogp - logp) - (rlogp - logp) - 1
        total = total + (-a * logp + kl_coef * k3).sum() / T
        value += (-a * len(c) + kl_coef * k3.sum().item()) / T
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    opt.step()
    return value, model.state_dict()


def with_ref(pol, ref_path, mesh):
    """the policy with another model as its KL reference, so the KL term is not 0 at the first
    step"""
    import rloo
    pol.ref = rloo.load_policy(ref_path, mesh, lr=0.0, warmup_steps=0, total_steps=1,
                               kl_coef=0.0).model
    pol.ref.eval().requires_grad_(False)
    return pol


def engine_prompt_logprobs(llm, seqs):
    from vllm import SamplingParams
    outs = llm.vllm.generate([{"prompt_token_ids": s} for s in seqs],
                        SamplingParams(prompt_logprobs=0, max_tokens=1), use_tqdm=False)
    return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])]
            for o, s in zip(outs, seqs)]


def main(out, base, ref):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import rloo
    import rloo_extras
    t0 = [time.time()]
    res = dict(times={})

    def tick(name):   # seconds per section, for the test's report
        res["times"][name] = round(time.time() - t0[0], 2)
        t0[0] = time.time()

    rank, world, dev = rloo.init_distributed()
    rloo.LOGIT_CHUNK_TOKENS = 16   # several vocab-head chunks per micro-batch (token_logprobs)
    # processed: the sampled tokens' logprobs at the sampling temperature (the training check)
    llm = rloo.build_engine(base, max_model_len=1024, logprobs_mode="processed_logprobs")
    mesh = init_device_mesh("cpu", (world,))
    W = dist.group.WORLD
    res["world"] = world

    tick("init")
    # --- generate: split over ranks, order, seeds, greedy
    gen = rloo.generate(llm, PROMPTS, n=3, max_tokens=12, seed=11, group=W)
    res["gen"] = [[s.token_ids for s in o] for o in gen]
    res["gen_prompt_ids"] = [[s.prompt_token_ids for s in o] for o in gen]
    res["greedy"] = [[s.token_ids for s in o] for o in
                     rloo.generate(llm, PROMPTS, n=2, temperature=0, max_tokens=8, seed=0, group=W)]
    res["local_gen"] = [[s.token_ids for s in o] for o in   # no group: this rank alone
                        rloo.generate(llm, PROMPTS[:2], n=3, max_tokens=12, seed=11)]
    # one prompt 4 times, n = 8 each: 32 samples that must be 32 independent draws
    res["repeated"] = [s.token_ids for o in rloo.generate(llm, [PROMPTS[0]] * 4, n=8, max_tokens=12,
                                                          seed=3, group=W) for s in o]

    # more prompt tokens than one 4096-token prefill batch holds, seeded: vLLM's CPU runner crashes
    # on a chunked prefill of a seeded request unless build_engine turns chunking off
    big = [" ".join([PROMPTS[i % 7]] * 30) + f" {i}" for i in range(64)]
    res["big"] = [len(o) for o in rloo.generate(llm, big, n=2, max_tokens=2, seed=5)]
    res["big_prompt_tokens"] = sum(len(o[0].prompt_token_ids)
                                   for o in rloo.generate(llm, big, max_tokens=1, seed=5))

    # the teacher prompt goes in as ids and comes back (the ids the trainer scores) unchanged, with
    # one BOS; the same prompt as text would get a second BOS from the engine's tokenizer
    import data
    ids = data.teacher_prompt(llm.vllm.get_tokenizer())
    res["teacher_ids"] = ids
    res["engine_ids"] = rloo.generate(llm, [ids], max_tokens=2, seed=0)[0][0].prompt_token_ids
    text = llm.vllm.get_tokenizer().decode(ids)
    res["engine_ids_of_text"] = rloo.generate(llm, [text], max_tokens=2,
                                              seed=0)[0][0].prompt_token_ids

    tick("generate")
    # --- one RLOO step on a fixed batch, KL to a different reference model
    kl_coef, lr = 0.1, 1e-3
    pol = with_ref(rloo.load_policy(base, mesh, lr=lr, warmup_steps=0, total_steps=10,
                                    kl_coef=kl_coef), ref, mesh)
    prompts, comps, rewards = fixed_batch()
    adv = rloo.rloo_advantages(rewards).flatten().tolist()
    lo, hi = rloo.chunk(len(prompts), rank, world)
    snap0 = rloo_extras.snapshot(pol)
    # a small token budget forces several micro-batches, unevenly many per rank (dummies)
    res["step"] = train_step(pol, prompts[lo:hi], comps[lo:hi], adv[lo:hi],
                                  micro_batch_tokens=24)
    w1 = full_weights(pol.model)
    # activation checkpointing (the GPU setting for 3B models) must not change the update
    pol_ac = with_ref(rloo.load_policy(base, mesh, lr=lr, warmup_steps=0, total_steps=10,
                                       kl_coef=kl_coef, activation_checkpointing=True), ref, mesh)
    res["step_ac"] = train_step(pol_ac, prompts[lo:hi], comps[lo:hi], adv[lo:hi],
                                     micro_batch_tokens=24)
    w_ac = full_weights(pol_ac.model)
    del pol_ac
    # one causal pass per row instead of shared prompts: the same update
    pol_single = with_ref(rloo.load_policy(base, mesh, lr=lr, warmup_steps=0, total_steps=10,
                                           kl_coef=kl_coef, prompts="single"), ref, mesh)
    res["step_single"] = train_step(pol_single, prompts[lo:hi], comps[lo:hi], adv[lo:hi],
                                    micro_batch_tokens=24)
    w_single = full_weights(pol_single.model)
    del pol_single
    if rank == 0:
        res["w1"], res["w_ac"], res["w_single"] = w1, w_ac, w_single
        res["hand_value"], res["hand_w"] = hand_reference(base, ref, prompts, comps, adv, kl_coef,
                                                          lr, 1.0)

    tick("train_step")
    # --- weight sync: engine prompt logprobs == trainer logprobs after the update
    rloo.sync_weights(pol, llm)
    seqs = [p + c for p, c in zip(prompts, comps)]
    with torch.no_grad():
        tr = rloo.token_logprobs(pol.model, [s[:1] for s in seqs], [s[1:] for s in seqs])[0]
    eng = engine_prompt_logprobs(llm, seqs)
    res["sync_err"] = max(abs(tr[i, t].item() - e)
                          for i, row in enumerate(eng) for t, e in enumerate(row))

    # --- the trainer's log-probs at the sampling temperature are the engine's (on-policy at T != 1)
    from vllm import SamplingParams
    outs = llm.vllm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                        SamplingParams(temperature=0.7, logprobs=0, max_tokens=6, seed=3),
                        use_tqdm=False)
    for T in (0.7, 1.0):
        errs = []
        for p, o in zip(prompts[:4], outs):
            c = o.outputs[0]
            with torch.no_grad():
                lp = rloo.token_logprobs(pol.model, [p], [list(c.token_ids)], T)[0][0]
            errs += [abs(lp[t].item() - c.logprobs[t][tok].logprob)
                     for t, tok in enumerate(c.token_ids)]
        res[f"temperature_err_{T}"] = max(errs)

    tick("sync")
    # --- snapshot / restore: bit-identical
    snap1 = rloo_extras.snapshot(pol)
    rloo_extras.restore(pol, snap0)
    res["restore_ok"] = all(torch.equal(v, snap0[k]) for k, v in rloo_extras.snapshot(pol).items())
    res["snap_differs"] = any(not torch.equal(snap0[k], snap1[k]) for k in snap0)
    rloo_extras.restore(pol, snap1)

    tick("snapshot")
    # --- save_state / load_state: resuming reproduces the next step bit for bit
    ckpt = os.path.join(out, "ckpt")
    rloo_extras.save_state(pol, ckpt)
    rloo_extras.save_state(pol, ckpt)           # a second save over the first
    m2 = train_step(pol, prompts[lo:hi], comps[lo:hi], adv[lo:hi], micro_batch_tokens=24)
    w2 = full_weights(pol.model)
    # as after a restart: a freshly loaded policy (empty optimizer state) picks up the checkpoint
    pol_b = with_ref(rloo.load_policy(base, mesh, lr=lr, warmup_steps=0, total_steps=10,
                                      kl_coef=kl_coef), ref, mesh)
    rloo_extras.load_state(pol_b, ckpt)
    res["load_ok"] = all(torch.equal(v, w1[k]) for k, v in full_weights(pol_b.model).items())
    m2b = train_step(pol_b, prompts[lo:hi], comps[lo:hi], adv[lo:hi], micro_batch_tokens=24)
    res["resume_ok"] = m2 == m2b and all(torch.equal(v, w2[k])
                                         for k, v in full_weights(pol_b.model).items())
    del pol_b
    res["ckpt_clean"] = [f for f in sorted(os.listdir(out)) if f.startswith("ckpt")]

    tick("checkpoint")
    # --- save_hf: from_pretrained gives back the trained weights
    from transformers import AutoModelForCausalLM, AutoTokenizer
    rloo_extras.save_hf(pol, os.path.join(out, "hf"), AutoTokenizer.from_pretrained(base))
    if rank == 0:
        m = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf"))
        res["hf_ok"] = all(torch.equal(v, w2[k]) for k, v in m.state_dict().items())

    tick("save_hf")
    # --- learning: reward = share of completion tokens with id < TARGET
    pol.kl_coef = 0.001   # the paper's value (0.1 above pulls hard toward the unrelated ref model)
    rloo.reset_optimizer(pol, lr=2e-2, warmup_steps=0, total_steps=100)
    snap_l = rloo_extras.snapshot(pol)
    res["rewards"] = []
    for k in range(5):
        rloo.sync_weights(pol, llm)
        out_k = rloo.generate(llm, PROMPTS[:6], n=8, max_tokens=8, seed=1000 * k, group=W)
        r = torch.tensor([[sum(t < TARGET for t in s.token_ids) / max(len(s.token_ids), 1)
                           for s in o] for o in out_k])
        res["rewards"].append(r.mean().item())
        a = rloo.rloo_advantages(r).flatten().tolist()
        pr = [s.prompt_token_ids for o in out_k for s in o]
        cp = [s.token_ids for o in out_k for s in o]
        lo2, hi2 = rloo.chunk(len(cp), rank, world)
        train_step(pol, pr[lo2:hi2], cp[lo2:hi2], a[lo2:hi2])
    res["unchanged"] = [k for k, v in rloo_extras.snapshot(pol).items()
                        if torch.equal(v, snap_l[k])]

    tick("learning")
    # --- a non-finite loss skips its update (weights unchanged); MAX_NONFINITE in a row end the run
    before = rloo_extras.snapshot(pol)
    nan = [float("nan")] * (hi - lo)
    res["nan_skipped"] = train_step(pol, prompts[lo:hi], comps[lo:hi], nan)["skipped"]
    res["nan_unchanged"] = all(torch.equal(v, before[k])
                               for k, v in rloo_extras.snapshot(pol).items())
    res["finite_after"] = not train_step(pol, prompts[lo:hi], comps[lo:hi],
                                              adv[lo:hi])["skipped"]
    try:
        for _ in range(rloo.MAX_NONFINITE):
            train_step(pol, prompts[lo:hi], comps[lo:hi], nan)
        res["nan_error"] = None
    except RuntimeError as e:
        res["nan_error"] = str(e)

    # --- promotion: broadcast one student group's shards to the other groups (2-D mesh)
    mesh2d = init_device_mesh("cpu", (world, 1), mesh_dim_names=("group", "fsdp"))
    st = rloo.load_policy(base, mesh2d["fsdp"], lr=1e-3, warmup_steps=0, total_steps=10,
                          kl_coef=0.0)
    rows = slice(2 * rank, 2 * rank + 4)   # each group trains on different data
    train_step(st, prompts[rows], comps[rows], adv[rows])
    snap = rloo_extras.snapshot(st)
    res["student_before"] = {k: v.clone() for k, v in snap.items()}
    rloo_extras.broadcast_snapshot(snap, src=world - 1, group=mesh2d["group"].get_group())
    rloo_extras.restore(st, snap)
    res["student_after"] = rloo_extras.snapshot(st)
    # a checkpoint of a policy on a sub-mesh (the groups hold the same theta now, as in SOAR)
    rloo_extras.save_state(st, os.path.join(out, "ckpt2d"))
    train_step(st, prompts[rows], comps[rows], adv[rows])
    rloo_extras.load_state(st, os.path.join(out, "ckpt2d"))
    res["student_reloaded"] = rloo_extras.snapshot(st)

    tick("broadcast")
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()   # no destroy_process_group: vLLM's exit handler still uses the groups


if __name__ == "__main__":
    main(*sys.argv[1:4])
