"""
LoRA (lora.py) on real parts: adapters on one frozen base, the vLLM CPU engine serving them, two
ranks under torchrun (gloo). The worker (tests/lora_worker.py) runs as a plain 1-rank process (then
once more with its weight sync broken on purpose) and under `torchrun --nproc_per_node 2`; the tests
assert on what they wrote. peft (a test dependency) proves that our adapter folders are PEFT's.
"""
import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import lora  # noqa: E402
import rloo  # noqa: E402
from lora_worker import LR, RANK  # noqa: E402
from rloo_dist_worker import fixed_batch, make_tiny_model  # noqa: E402
from test_rloo import _run  # noqa: E402   (a worker under its launcher)

EXACT = 1e-4   # engine vs trainer log-probs, fp32 on both sides (1e-6 measured)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = str(d / "base")
    make_tiny_model(base, seed=0)
    worker = os.path.join(HERE, "lora_worker.py")
    _run([sys.executable, worker, str(d / "w1"), base, "stale"], str(d / "w1"))
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", worker,
          str(d / "w2"), base], str(d / "w2"))
    def load(p):
        return torch.load(p, weights_only=False)
    one = load(d / "w1" / "rank0.pt")
    return dict(base=base, dir=d, one=one, two=[load(d / "w2" / f"rank{r}.pt") for r in range(2)],
                stale=dict(errs=one["stale_errs"]))


def test_adapters_on_one_frozen_base(runs):
    for res in [runs["one"], *runs["two"]]:
        assert res["base_frozen"] and res["shared_base"]
        names = res["adapter_names"]
        # every linear layer of both decoder layers: 4 attention + 3 MLP projections, A and B
        assert len(names) == 2 * 7 * 2 and all(n.startswith("model.layers.") for n in names)
        assert res["optimized"] == len(names)   # only the adapter is in the optimizer
        assert res["fresh_is_base"]              # B = 0: a fresh adapter is the base exactly
        assert res["live_adapters"] == 2         # each policy's old versions left the engine


def test_the_engine_serves_each_adapter_as_trained(runs):
    """after each of 3 updates (one multi-adapter call for both), after a restore to theta (a
    promotion's restart), after a resume, and from the saved PEFT folder"""
    for res in [runs["one"], *runs["two"]]:
        assert len(res["errs"]) == 6
        for errs in res["errs"]:
            assert max(errs) < EXACT, res["errs"]
        assert all(not s["skipped"] and s["grad_norm"] > 0 for s in res["steps"])


def test_students_in_one_call_equal_students_in_turn(runs):
    """lora.rl_steps: two adapters' rollouts in one engine call, then an update each, as one
    rl_step after the other with the same request seeds: the same samples, the same adapters"""
    for res in [runs["one"], *runs["two"]]:
        lockstep = res["lockstep"]
        assert lockstep["rewards"] == lockstep["rewards_apart"]
        assert len(set(map(tuple, lockstep["rewards"]))) == 2   # the two students sampled apart
        assert lockstep["moved"] and lockstep["max_diff"] < 1e-6, lockstep["max_diff"]


def test_an_adapter_is_served_on_its_base_after_full_weights(runs):
    """a full HF folder served straight into the engine is served exactly (eval.py's inference
    rows); an adapter served or synced after full weights of another model gets its base back
    (5.99 nats off before lora.serve_adapter put the base back)"""
    for res in [runs["one"], *runs["two"]]:
        assert max(res["full_served"]) < EXACT, res["full_served"]
        assert max(res["after_full_served"]) < EXACT, res["after_full_served"]
        assert max(res["after_full_synced"]) < EXACT, res["after_full_synced"]


def test_a_stale_adapter_is_caught(runs):
    """the first checks again (fresh adapters, in the 1-rank worker) with new weights written under
    the old adapter id: the engine keeps serving what it loaded first, and the log-probs say so
    from the first update on"""
    errs = runs["stale"]["errs"]
    assert max(errs[0]) < EXACT          # before any update nothing is stale yet
    assert min(errs[1]) > 100 * EXACT and min(errs[2]) > 100 * EXACT, errs


def test_two_ranks_equal_one_rank(runs):
    """each rank trains on its half of the batch; the averaged gradients give one rank's update"""
    one = runs["one"]["teacher_trained"]
    for res in runs["two"]:
        for k, v in res["teacher_trained"].items():
            assert (v - one[k]).abs().max() < 2 * LR * 3, k   # 3 updates (Adam's sign noise)
            assert (v - one[k]).abs().float().gt(1e-5).float().mean() < 1e-2, k
    a, b = (r["teacher_trained"] for r in runs["two"])
    assert all(torch.equal(a[k], b[k]) for k in a)   # replicas stay equal


def test_resume_is_equal_and_checkpoints_hold_the_adapter_only(runs):
    for res in [runs["one"], *runs["two"]]:
        assert res["resume_equal"]
        assert res["ckpt_files"] == ["adapter.pt"]
    ckpt = runs["dir"] / "w2" / "ckpt" / "adapter.pt"
    n_adapter = sum(v.numel() for v in runs["one"]["teacher_trained"].values())
    assert os.path.getsize(ckpt) < 3 * 4 * n_adapter + 100_000   # fp32 adapter + AdamW moments


def test_peft_loads_our_adapter_folder(runs):
    import peft   # a test dependency (requirements.txt)
    from transformers import AutoModelForCausalLM
    folder = runs["dir"] / "w1" / "teacher"
    assert os.path.islink(folder) and (folder / "soar.json").exists()
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["base_model_name_or_path"] == runs["base"]
    model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(runs["base"], dtype=torch.float32), str(folder))
    prompts, comps, _ = fixed_batch()
    ours = runs["one"]["saved_logprobs"]
    with torch.no_grad():
        for i, (p, c) in enumerate(zip(prompts, comps)):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:len(p) + len(c) - 1]
            lp = torch.log_softmax(logits.float(), -1)[torch.arange(len(c)), c]
            assert (lp - ours[i, :len(c)]).abs().max() < 1e-5


def test_one_engine_call_holds_several_policies_only_as_adapters():
    """lora.requests_of: each request names its policy's adapter (what its sync returned); one
    policy needs none (the engine serves what was synced last); several full fine-tuned policies
    (synced as the engine's weights, None) cannot share a call"""
    assert lora.requests_of(["a", "b"], [2, 1]) == ["a", "a", "b"]
    assert lora.requests_of(["a"], [3]) is None
    assert lora.requests_of([None], [3]) is None
    with pytest.raises(ValueError, match="LoRA"):
        lora.requests_of(["a", None], [1, 1])


def bench():
    """bench/bench_rloo.py as a module"""
    import importlib.util
    path = os.path.join(os.path.dirname(HERE), "bench", "bench_rloo.py")
    spec = importlib.util.spec_from_file_location("bench_rloo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_memory_table_counts_adapters_from_the_config():
    """bench --memory_table on Llama-3.2-3B's shape, rank 32: an adapter is 48.6 M parameters
    (issue #39's arithmetic), and PopuLoRA's 8 + 8 hold sixteen of them on every rank, with AdamW,
    and the gradients of the one that trains, twice (their flat copy for the all-reduce)"""
    text = bench().memory_table("llama3b", 32)
    assert "an adapter 48.6 M" in text
    held, gradients = 12 * 48.6e6 / 2 ** 30, 4 * 48.6e6 / 2 ** 30   # fp32 weights and AdamW
    assert f"adapters {16 * held + 2 * gradients:.1f}" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 6   # the header, then 1 to 32 GPUs


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_base_is_in_eval_mode_and_still_recomputes(tmp_path, checkpointing):
    """lora.load_base on a config with attention dropout: without an adapter the base (the KL
    reference) gives the same log-probs every time, and with activation checkpointing each decoder
    layer still runs again in backward (HF recomputes only in a training layer), same gradients"""
    path = str(tmp_path / "base")
    make_tiny_model(path)
    config = json.loads(open(os.path.join(path, "config.json")).read())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "attention_dropout": 0.5}, f)
    prompts, comps, _ = fixed_batch()
    grads = {}
    for ckpt in (False, checkpointing):
        model = lora.load_base(path, torch.device("cpu"), ckpt)
        reference = lora.AdapterModel(model, None, 16.0, path)
        with torch.no_grad():
            ref = [rloo.token_logprobs(reference, prompts, comps)[0] for _ in range(2)]
        assert torch.equal(*ref)   # no dropout: the same reference twice
        policy = lora.AdapterModel(model, lora.new_adapter(model, RANK, 0), 16.0, path)
        with torch.no_grad():
            B = policy.adapter["model.layers.0.mlp.up_proj.lora_B"]
            B.normal_(generator=torch.Generator().manual_seed(0))   # B != 0: gradients to A too
        calls = []
        model.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
        rloo.token_logprobs(policy, prompts, comps)[0].sum().backward()
        # shared prompts: two passes (prompts, completions), each run again in backward if ckpt
        assert len(calls) == (4 if ckpt else 2)
        grads[ckpt] = {k: p.grad for k, p in policy.named_parameters()}
    for k, g in grads[False].items():
        torch.testing.assert_close(grads[checkpointing][k], g)


def test_adapters_go_to_shm_only_where_they_fit(tmp_path):
    """lora.adapter_root: the RAM-backed folder when it has room for the adapters, else the
    temporary folder (a container's 64 MB /dev/shm holds no rank-32 3B adapter, 97 MB in bf16)"""
    import shutil
    from transformers import LlamaConfig
    free = shutil.disk_usage(tmp_path).free
    assert lora.adapter_root(free // 2, shm=str(tmp_path)) == str(tmp_path)
    assert lora.adapter_root(free * 2, shm=str(tmp_path)) is None
    assert lora.adapter_root(1, shm=str(tmp_path / "none")) is None
    a = lora.adapter_parameters(LlamaConfig(**bench().SHAPES["llama3b"]), 32)
    assert 2 * a / 1e6 == pytest.approx(97.2, abs=0.1)   # MB in bf16
