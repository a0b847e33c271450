"""
Worker for tests/test_lora.py: run as `python tests/lora_worker.py OUT BASE [stale]` (1 rank, no
torchrun) or under `torchrun --nproc_per_node 2`. A teacher and a student as LoRA adapters on one
frozen base, served by the real vLLM CPU engine; writes what it measured to OUT/rank{r}.pt, and the
test makes the assertions. `stale` then does the first checks again with fresh adapters on the same
engine and the weight sync broken on purpose (new weights under the old adapter id, the bug vLLM's
adapter cache makes easy), to show that the checks catch it.
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
from rloo_dist_worker import PROMPTS, fixed_batch  # noqa: E402

RANK = 8
LR = 1e-2
OPTS = dict(lr=LR, warmup_steps=0, total_steps=10, rank=RANK, alpha=16.0, kl_coef=0.1)


def engine_vs_trainer(llm, served, seed):
    """One multi-adapter call: PROMPTS sampled under each (policy, its LoRARequest) of `served`;
    per adapter, the largest |engine log-prob - trainer log-prob| of the sampled tokens"""
    import rloo
    k = len(PROMPTS)
    outs = rloo.generate(llm, PROMPTS * len(served), n=2, max_tokens=10, seed=seed, logprobs=True,
                         adapters=[request for _, request in served for _ in PROMPTS])
    errs = []
    for i, (policy, _) in enumerate(served):
        flat = [s for o in outs[i * k:(i + 1) * k] for s in o]
        with torch.no_grad():
            lp, mask = rloo.token_logprobs(policy.model, [s.prompt_token_ids for s in flat],
                                           [s.token_ids for s in flat])
        engine = torch.zeros_like(lp)
        for row, s in enumerate(flat):
            engine[row, :len(s.logprobs)] = torch.tensor(s.logprobs)
        errs.append(((lp - engine) * mask).abs().max().item())
    return errs


def lockstep(llm, student, theta, base, mesh):
    """Two students from theta, one RL step each: in one multi-adapter call (lora.rl_steps, as
    soar.py's LoRA students train), then again one after another, each with the seeds its requests
    had in the shared call. Returns both runs' rewards and the largest adapter difference."""
    import lora
    import rloo
    import rloo_extras
    other = lora.load_policy(base, mesh, seed=4, base=lora.base_of(student), **OPTS)
    batches = [[(PROMPTS[0], ""), (PROMPTS[1], "")], [(PROMPTS[2], ""), (PROMPTS[3], "")]]
    kw = dict(prompt=lambda q: q, reward=lambda texts, _: [len(t) / 10 for t in texts], samples=4,
              temperature=1.0, max_tokens=8, group=mesh.get_group(), micro_batch_tokens=256,
              advantages=rloo.rloo_advantages, loss=rloo.rloo_loss)
    runs = []
    for together in (True, False):
        for policy in (student, other):
            rloo_extras.restore(policy, theta)
            rloo.reset_optimizer(policy, **{k: OPTS[k] for k in ("lr", "warmup_steps",
                                                                 "total_steps")})
        if together:
            stats = lora.rl_steps([student, other], llm, batches, seed=20, **kw)
        else:
            stats = [rloo.rl_step(student, llm, batches[0], seed=20, **kw),
                     rloo.rl_step(other, llm, batches[1],
                                  seed=20 + len(batches[0]) * kw["samples"], **kw)]
        runs.append(([s["rewards"] for s in stats],
                     [rloo_extras.snapshot(student), rloo_extras.snapshot(other)]))
    (rewards, snaps), (rewards_apart, snaps_apart) = runs
    diff = max((a[k] - b[k]).abs().max().item()
               for a, b in zip(snaps, snaps_apart) for k in a)
    return dict(rewards=rewards, rewards_apart=rewards_apart, max_diff=diff,
                moved=any(not torch.equal(snaps[1][k], theta[k]) for k in theta))


def stale_errs(llm, base, mesh, lo, hi):
    """main's first checks again, with the weight sync broken (stale_sync): a fresh teacher and
    student on the engine (none of before left in it, so none is evicted and reloaded), synced,
    compared and updated 3 times; the errors after each sync"""
    import lora
    import rloo
    global SYNC
    for lora_id in list(llm.vllm.llm_engine.list_loras()):
        llm.vllm.llm_engine.remove_lora(lora_id)
    SYNC, lora.sync_weights = lora.sync_weights, stale_sync
    prompts, comps, rewards = fixed_batch()
    adv = rloo.rloo_advantages(rewards).flatten().tolist()
    teacher = lora.load_policy(base, mesh, seed=1, **OPTS)
    student = lora.load_policy(base, mesh, seed=2, base=lora.base_of(teacher), **OPTS)
    errs = []
    for it in range(3):
        for policy in (teacher, student):
            rloo.sync_weights(policy, llm)
        errs.append(engine_vs_trainer(llm, [(teacher, teacher.model.served),
                                            (student, student.model.served)], seed=it))
        for policy in (teacher, student):
            rloo.train_step(policy, prompts[lo:hi], comps[lo:hi], adv[lo:hi],
                            loss=rloo.rloo_loss, temperature=1.0, micro_batch_tokens=24)
    lora.sync_weights = SYNC
    return errs


def stale_sync(policy, llm):
    """the broken sync: the policy's new weights rewritten into its first folder and added under
    its first id, which the engine already holds"""
    import lora
    served = policy.model.served
    if served is None:
        return SYNC(policy, llm)
    lora.write_adapter(policy, served.lora_path, llm.vllm.llm_engine.model_config.dtype)
    llm.vllm.llm_engine.add_lora(served)
    llm.adapter = served
    return served


def full_folder_then_adapter(llm, policy, folder, out, mesh):
    """Another model's full HF folder served (eval.py's inference row of a full fine-tune), then
    policy's PEFT folder on top; the same with the full weights and the adapter synced from trainers
    (a LoRA fresh student after a full one). Each adapter must be served on its base, not on what
    the engine held last."""
    import torch.distributed as dist
    import lora
    import rloo
    import rloo_extras
    from rloo_dist_worker import make_tiny_model
    other = os.path.join(out, "other")
    if rloo.rank0():
        make_tiny_model(other, seed=5)
    dist.barrier()
    full = rloo.load_policy(other, mesh, lr=0.0, warmup_steps=0, total_steps=1, kl_coef=0.0)
    rloo_extras.serve_hf(llm, other)
    res = {"full_served": engine_vs_trainer(llm, [(full, None)], seed=13)}
    res["after_full_served"] = engine_vs_trainer(llm, [(policy, lora.serve_adapter(llm, folder))],
                                                 seed=14)
    rloo.sync_weights(full, llm)
    rloo.sync_weights(policy, llm)
    res["after_full_synced"] = engine_vs_trainer(llm, [(policy, policy.model.served)], seed=15)
    return res


def main(out, base, mode=""):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer
    import lora
    import rloo
    import rloo_extras
    rank, world, _ = rloo.init_distributed()
    mesh = init_device_mesh("cpu", (world,))
    # processed: the sampled tokens' log-probs at the sampling temperature, as the trainer's
    llm = rloo.build_engine(base, max_model_len=256, **lora.engine_args(RANK, 3),
                            logprobs_mode="processed_logprobs")
    teacher = lora.load_policy(base, mesh, seed=1, **OPTS)
    student = lora.load_policy(base, mesh, seed=2, base=lora.base_of(teacher), **OPTS)
    res = dict(world=world, adapter_names=sorted(teacher.model.adapter),
               base_frozen=not any(p.requires_grad for p in lora.base_of(teacher).parameters()),
               optimized=sum(len(g["params"]) for g in teacher.optimizer.param_groups),
               shared_base=lora.base_of(student) is lora.base_of(teacher))
    prompts, comps, rewards = fixed_batch()
    adv = rloo.rloo_advantages(rewards).flatten().tolist()
    lo, hi = rloo.chunk(len(prompts), rank, world)

    # a fresh adapter (B = 0) is the base exactly
    with torch.no_grad():
        with_adapter = rloo.token_logprobs(teacher.model, prompts, comps)[0]
        without = rloo.token_logprobs(teacher.ref, prompts, comps)[0]   # the base alone
    res["fresh_is_base"] = torch.equal(with_adapter, without)

    # after each of several updates, the engine serves both adapters as the trainer holds them
    theta = rloo_extras.snapshot(student)
    res["errs"] = []
    res["steps"] = []
    for it in range(3):
        for policy in (teacher, student):
            rloo.sync_weights(policy, llm)
        res["errs"].append(engine_vs_trainer(llm, [(teacher, teacher.model.served),
                                                   (student, student.model.served)], seed=it))
        for policy in (teacher, student):
            res["steps"].append(rloo.train_step(policy, prompts[lo:hi], comps[lo:hi], adv[lo:hi],
                                                loss=rloo.rloo_loss, temperature=1.0,
                                                micro_batch_tokens=24))
    res["teacher_trained"] = rloo_extras.snapshot(teacher)
    res["live_adapters"] = len(llm.vllm.llm_engine.list_loras())
    res["lockstep"] = lockstep(llm, student, theta, base, mesh)

    # a promotion's restart: the student back to theta, synced
    rloo_extras.restore(student, theta)
    rloo.sync_weights(student, llm)
    res["errs"].append(engine_vs_trainer(llm, [(student, student.model.served)], seed=10))

    # a resume: the teacher's checkpoint in a fresh policy on the same base, then the same update
    ckpt = os.path.join(out, "ckpt")
    rloo_extras.save_state(teacher, ckpt)
    res["ckpt_files"] = sorted(os.listdir(ckpt))
    step = rloo.train_step(teacher, prompts[lo:hi], comps[lo:hi], adv[lo:hi],
                           loss=rloo.rloo_loss, temperature=1.0)
    resumed = lora.load_policy(base, mesh, seed=3, base=lora.base_of(teacher), **OPTS)
    rloo_extras.load_state(resumed, ckpt)
    step_b = rloo.train_step(resumed, prompts[lo:hi], comps[lo:hi], adv[lo:hi],
                             loss=rloo.rloo_loss, temperature=1.0)
    after = rloo_extras.snapshot(teacher)
    res["resume_equal"] = step == step_b and all(torch.equal(v, after[k])
                                                 for k, v in rloo_extras.snapshot(resumed).items())
    rloo.sync_weights(resumed, llm)
    res["errs"].append(engine_vs_trainer(llm, [(resumed, resumed.model.served)], seed=11))

    # the final write: a PEFT folder, served again from there, and what PEFT must reproduce
    folder = os.path.join(out, "teacher")
    rloo_extras.save_hf(resumed, folder, AutoTokenizer.from_pretrained(base),
                        extra={"soar.json": {}})
    request = lora.serve_adapter(llm, folder)
    res["errs"].append(engine_vs_trainer(llm, [(resumed, request)], seed=12))
    with torch.no_grad():
        res["saved_logprobs"] = rloo.token_logprobs(resumed.model, prompts, comps)[0]
    res.update(full_folder_then_adapter(llm, resumed, folder, out, mesh))
    if mode == "stale":
        res["stale_errs"] = stale_errs(llm, base, mesh, lo, hi)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()   # no destroy_process_group: vLLM's exit handler still uses the groups


if __name__ == "__main__":
    main(*sys.argv[1:4])
