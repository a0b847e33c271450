"""
rloo.py on real parts: the vLLM CPU engine and FSDP2 over gloo. The worker
(tests/rloo_dist_worker.py) runs once as a plain 1-rank process and once under
`torchrun --nproc_per_node 2`; the tests below assert on what both runs wrote.
"""
import itertools
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
import launch  # noqa: E402
import rloo  # noqa: E402
import rloo_extras  # noqa: E402
from rloo_dist_worker import PROMPTS, fixed_batch, make_tiny_model  # noqa: E402

LR = 1e-3   # the worker's lr for the fixed-batch step


def _run(cmd, out):
    os.makedirs(out)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("rloo")
    base, ref = str(d / "base"), str(d / "ref")
    tok = make_tiny_model(base, seed=0)
    make_tiny_model(ref, seed=1)
    worker = os.path.join(HERE, "rloo_dist_worker.py")
    _run([sys.executable, worker, str(d / "w1"), base, ref], str(d / "w1"))   # no torchrun
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", worker,
          str(d / "w2"), base, ref], str(d / "w2"))
    one = torch.load(d / "w1" / "rank0.pt", weights_only=False)
    two = [torch.load(d / "w2" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    print("section seconds, 1 rank:", one["times"], "\n2 ranks:", two[0]["times"])
    return dict(one=one, two=two, tok=tok)


def _close_updates(a, b, lr):
    """weights after one AdamW step from the same start. Adam's first step is lr * g/(|g|+eps),
    so the few elements whose gradient is ~eps (its sign noise) may differ by up to 2 lr under
    another summation order; everything else must agree to float precision."""
    for k in a:
        d = (a[k] - b[k]).abs()
        assert d.max() < 2 * lr, k
        assert (d > 1e-6).float().mean() < 1e-3, k


def test_rloo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(rloo.rloo_advantages(r), torch.tensor([2, -2, -2, 2]) / 3)
    r2 = torch.tensor([[3.0, 1.0, 2.0], [0.0, 0.0, 0.0]])   # [questions, samples]
    torch.testing.assert_close(rloo.rloo_advantages(r2),
                               torch.tensor([[1.5, -1.5, 0.0], [0, 0, 0]]))
    assert rloo.rloo_advantages(torch.rand(5, 7)).sum(-1).abs().max() < 1e-6   # sums to zero


def test_ppo_clip_stops_the_gradient_once_the_ratio_leaves_the_band():
    """rloo.ppo_loss (SeRL's updates): per token -min(r A, clip(r, 0.8, 1.2) A). Inside the band
    the gradient is -A r; outside it, in A's direction (r > 1.2 with A > 0, r < 0.8 with A < 0),
    none; against A's direction the unclipped term stays (min takes it)"""
    old = torch.zeros(1, 6)
    ratio = torch.tensor([[1.0, 1.1, 1.5, 0.5, 1.5, 0.5]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, -1.0, 1.0]])
    logp = ratio.log().requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])   # the last: padding
    total, pg, kl = rloo.ppo_loss(logp, None, adv, mask, 0.0, old_logp=old)
    total.backward()
    assert kl == 0 and pg.item() == pytest.approx(-1.0 + 1.1 - 1.2 + 0.8 + 1.5)
    # d(-A r)/d logp = -A r: tokens 0, 1 inside; 2 and 3 clipped in A's direction; 4 against it
    assert logp.grad.tolist()[0] == pytest.approx([-1.0, 1.1, 0.0, 0.0, 1.5, 0.0])


def test_several_updates_take_shuffled_minibatches_and_the_log_probs_before_the_first(monkeypatch):
    """rloo.learn with updates=k: the rollouts in k minibatches (shuffled by the seed, each rollout
    once), a train_step each; a loss that asks for old_logp (ppo_loss) gets every row's log-probs
    from before the first update, computed once; rloo_loss gets none. One update: every rollout in
    order, as one on-policy step. (train_step and the log-probs are recorded stand-ins: the logic
    of learn alone; the real update is test_loss_and_update_match_hand_computation.)"""
    calls, computed = [], []

    def train_step(policy, prompts, completions, advantages, *, old_logprobs=None, **_):
        calls.append((completions, advantages, old_logprobs))
        return dict(loss=1.0, pg_loss=1.0, kl=0.0, grad_norm=len(calls), lr=0.1, tokens=2.0,
                    skipped=False)

    def sequence_logprobs(model, prompts, completions, **_):
        computed.append(len(completions))
        return [[-float(c[0])] for c in completions]

    monkeypatch.setattr(rloo, "train_step", train_step)
    monkeypatch.setattr(rloo, "sequence_logprobs", sequence_logprobs)
    monkeypatch.setattr(rloo, "my_share", lambda items, group=None: items)   # one rank
    policy = SimpleNamespace(model=None, device="cpu", shared_prompts=False,
                             mesh=SimpleNamespace(get_group=lambda: None))
    flat = [(rloo.Sample(str(i), [i], [0]), "a") for i in range(8)]   # 2 questions x 4 samples
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    stats = rloo.learn(policy, flat, rewards, 4, group=None, advantages=rloo.rloo_advantages,
                       loss=rloo.ppo_loss, temperature=1.0, micro_batch_tokens=64, updates=4,
                       seed=3)
    assert len(calls) == 4 and computed == [8]
    rows = [c[0] for completions, _, _ in calls for c in completions]
    assert sorted(rows) == list(range(8)) and rows != list(range(8))   # each once, shuffled
    assert all(old == [[-float(c[0])] for c in completions] for completions, _, old in calls)
    adv = rloo.rloo_advantages(torch.tensor(rewards).view(2, 4)).flatten().tolist()
    assert all(a == [adv[c[0]] for c in completions] for completions, a, _ in calls)
    assert stats["grad_norm"] == 2.5 and not stats["skipped"]   # the updates' mean
    calls.clear()
    rloo.learn(policy, flat, rewards, 4, group=None, advantages=rloo.rloo_advantages,
               loss=rloo.rloo_loss, temperature=1.0, micro_batch_tokens=64)
    assert [[c[0] for c in calls[0][0]]] == [list(range(8))] and calls[0][2] is None


def test_readable_units():
    assert [launch.readable(n) for n in (6.1e5, 1.2e8, 3.2125e9)] == ["0.61 M", "120 M", "3.21 B"]
    assert launch.readable(7.3e6, ((1e9, "GB"), (1e6, "MB"))) == "7.3 MB"


def test_a_step_damaged_twice_is_set_aside_twice(tmp_path):
    for n in (1, 2, 3):   # the same step-5 written again after each fallback, damaged again
        (tmp_path / "step-5").mkdir()
        (tmp_path / "step-5" / "f").write_text(str(n))
        suffix = ".damaged" + ("" if n == 1 else f"-{n}")
        assert launch.set_aside(str(tmp_path / "step-5")) == str(tmp_path / f"step-5{suffix}")
        assert (tmp_path / f"step-5{suffix}" / "f").read_text() == str(n)
    assert not (tmp_path / "step-5").exists()


class ScriptedVLLM:
    """what serve_hf and _reload_engine use of vLLM's LLM: reload_weights reads the first `reads`
    tensors it is given (None: all)"""
    def __init__(self, reads=None):
        self.reads = reads
        self.read = []
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))

    def collective_rpc(self, method, kwargs):
        weights = kwargs["weights_iterator"]
        self.read = [name for name, _ in itertools.islice(weights, self.reads)]

    def reset_prefix_cache(self):
        pass


def scripted_engine(base_path, reads=None):
    return rloo.Engine(ScriptedVLLM(reads), base_path, adapter_dir="", base_replaced=True)


def test_a_hub_named_base_served_again_is_the_base_and_unread_weights_are_an_error(tmp_path,
                                                                                   monkeypatch):
    """serve_hf of the engine's own base by its hub name (downloaded to a cache folder) leaves the
    base in place, so serve_adapter does not reload it again; another model replaces it. An engine
    that leaves weights unread is an error naming the first one."""
    from safetensors.torch import save_file
    from transformers.utils import hub
    folder = tmp_path / "snapshots" / "abc"
    folder.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": torch.ones(2, 2), "model.norm.weight": torch.ones(2)},
              str(folder / "model.safetensors"))
    monkeypatch.setattr(hub, "snapshot_download", lambda name, **kwargs: str(folder))
    llm = scripted_engine("org/tiny-model")
    rloo_extras.serve_hf(llm, "org/tiny-model")
    assert not llm.base_replaced
    assert llm.vllm.read == ["model.embed_tokens.weight", "model.norm.weight",
                             "lm_head.weight"]   # tied: the embedding
    rloo_extras.serve_hf(llm, "org/other-model")
    assert llm.base_replaced
    with pytest.raises(RuntimeError, match="left 2 tensors unread, the first model.norm.weight"):
        rloo_extras.serve_hf(scripted_engine("org/tiny-model", reads=1), "org/tiny-model")


def test_two_turns_end_the_question_where_the_format_filter_does(monkeypatch):
    """Turn 1 ends where the one-turn filter closes the question: at </question>, or at a second
    <question> (as the paper prints the format), cut at that token; turn 2 follows it, and the
    pair passes the filter (scripted engine, one character a token)"""
    import data
    from rloo import Sample
    decode = "".join   # a token is a character
    firsts = ["<question>What is 1+1?<question>More</question>",   # the engine stops at </question>
              "<question>What is 2+2?</question>", "no question</question>", "<question>open"]

    def fake_generate(llm, prompts, *, max_tokens, seed, stop=None, **kwargs):
        if stop:   # turn 1
            return [[Sample(text, list(text), list(prompt))]
                    for text, prompt in zip(firsts, prompts)]
        return [[Sample("\\boxed{2}</answer>", list("\\boxed{2}</answer>"), list(prompt))]
                for prompt in prompts]

    monkeypatch.setattr(rloo, "generate", fake_generate)
    tokenizer = SimpleNamespace(decode=decode)
    llm = SimpleNamespace(vllm=SimpleNamespace(get_tokenizer=lambda: tokenizer))
    samples, texts = rloo_extras.sample_turns(llm, list("p"), 4, answer_prompt=list("<answer>"),
                                       stop=data.QUESTION_STOP, turn_end=data.question_end,
                                       max_tokens=64, temperature=1.0, seed=0)
    assert decode(samples[0][0].token_ids) == "<question>What is 1+1?<question>"
    assert samples[1][0].text == firsts[1] and [len(s) for s in samples] == [2, 2, 1, 1]
    assert texts[0] == "<question>What is 1+1?<question><answer>\\boxed{2}</answer>"
    assert data.parse_teacher_batch(texts[:2]) == [("What is 1+1?", "2"), ("What is 2+2?", "2")]
    assert texts[2:] == ["", ""]


def test_micro_batches_and_chunks():
    assert rloo._micro_batches([5, 9, 2, 9], 20) == [[1, 3], [0, 2]]
    assert rloo._micro_batches([30], 8) == [[0]]            # an over-long row still runs alone
    assert [rloo.chunk(7, r, 2) for r in range(2)] == [(0, 4), (4, 7)]
    assert [rloo.chunk(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]


def test_loss_and_update_match_hand_computation(runs):
    one = runs["one"]
    assert one["step"]["loss"] == pytest.approx(one["hand_value"], rel=1e-5)
    assert one["step"]["kl"] > 0 and one["step"]["tokens"] == sum(map(len, fixed_batch()[1]))
    _close_updates(one["w1"], one["hand_w"], LR)


def test_two_ranks_equal_one_rank(runs):
    one, (r0, r1) = runs["one"], runs["two"]
    assert r0["step"] == r1["step"]
    for k in ("loss", "pg_loss", "kl", "grad_norm", "lr", "tokens"):
        assert r0["step"][k] == pytest.approx(one["step"][k], rel=1e-5, abs=1e-7), k
    _close_updates(one["w1"], r0["w1"], LR)


def test_activation_checkpointing_same_update(runs):
    for r in [runs["one"], runs["two"][0]]:
        assert r["step_ac"]["loss"] == pytest.approx(r["step"]["loss"], rel=1e-6)
        _close_updates(r["w1"], r["w_ac"], LR)


def test_one_causal_pass_same_update(runs):
    """token_logprobs' two paths (prompt_pass): shared prompts and one pass per row"""
    for r in [runs["one"], runs["two"][0]]:
        assert r["step_single"]["loss"] == pytest.approx(r["step"]["loss"], rel=1e-6)
        _close_updates(r["w1"], r["w_single"], LR)
    assert rloo.prompt_pass("auto", "cpu") and not rloo.prompt_pass("auto", "cuda")
    assert rloo.prompt_pass("shared", "cuda") and not rloo.prompt_pass("single", "cpu")


def test_weight_sync_exact(runs):
    for r in [runs["one"], *runs["two"]]:
        assert r["sync_err"] < 1e-4


def test_training_logprobs_at_the_sampling_temperature(runs):
    """what vLLM sampled at T = 0.7, scored by the trainer at 0.7, has the engine's log-probs (at 1
    they would be off by far more: the check can fail)"""
    for r in [runs["one"], *runs["two"]]:
        assert r["temperature_err_0.7"] < 1e-4 < 1e-2 < r["temperature_err_1.0"]


def test_generate(runs):
    one, (r0, r1) = runs["one"], runs["two"]
    tok = runs["tok"]
    # order: sample i belongs to prompt i, n samples each, split over 2 ranks (4 + 3 prompts)
    assert [o[0] for o in one["gen_prompt_ids"]] == [tok(p)["input_ids"] for p in PROMPTS]
    assert all(len(o) == 3 and len(set(map(tuple, o))) == 3 for o in one["gen"])   # n distinct
    # same seeds => same samples whatever the split; every rank of the group gets everything
    assert one["gen"] == r0["gen"] == r1["gen"]
    assert one["gen_prompt_ids"] == r0["gen_prompt_ids"] == r1["gen_prompt_ids"]
    assert one["local_gen"] == r0["local_gen"] == r1["local_gen"] == one["gen"][:2]
    # no two samples of one call share a seed: a prompt repeated 4 times with n = 8 gives 32
    # different completions of 12 tokens (a random tiny model: a repeat by chance is ~impossible;
    # with seed + i per request, 21 of the 32 were copies of another request's)
    for r in [one, r0, r1]:
        assert len(r["repeated"]) == 32 and len(set(map(tuple, r["repeated"]))) == 32
    # greedy: n copies of one deterministic completion, same everywhere
    assert all(len(o) == 2 and o[0] == o[1] and len(o[0]) == 8 for o in one["greedy"])
    assert one["greedy"] == r0["greedy"] == r1["greedy"]
    # a seeded batch larger than one prefill chunk completes (see build_engine)
    assert one["big"] == [2] * 64 and one["big_prompt_tokens"] > 4096


def test_teacher_prompt_reaches_the_engine_with_one_bos(runs):
    bos = runs["tok"].bos_token_id
    for r in [runs["one"], *runs["two"]]:
        assert r["engine_ids"] == r["teacher_ids"]         # the engine saw what the trainer scores
        assert r["teacher_ids"][0] == bos and r["teacher_ids"].count(bos) == 1
        assert r["engine_ids_of_text"][:2] == [bos, bos]   # the bug ids avoid: text gets a 2nd BOS


def test_snapshot_restore_checkpoints(runs):
    for r in [runs["one"], *runs["two"]]:
        assert r["snap_differs"] and r["restore_ok"]
        assert r["load_ok"] and r["resume_ok"]
        assert r["ckpt_clean"] == ["ckpt"]      # no .tmp / .old left behind
    assert runs["one"]["hf_ok"] and runs["two"][0]["hf_ok"]


def test_non_finite_updates_are_skipped_then_stop_the_run(runs):
    for r in [runs["one"], *runs["two"]]:
        assert r["nan_skipped"] and r["nan_unchanged"] and r["finite_after"]
        assert "non-finite loss" in r["nan_error"] and "3 updates in a row" in r["nan_error"]


def test_broadcast_snapshot(runs):
    r0, r1 = runs["two"]
    before0, before1 = r0["student_before"], r1["student_before"]
    assert any(not torch.equal(before0[k], before1[k]) for k in before0)   # groups diverged
    for k in before1:   # src = group rank 1: both groups now hold rank 1's student, bit for bit
        assert torch.equal(r0["student_after"][k], before1[k])
        assert torch.equal(r1["student_after"][k], before1[k])
        assert torch.equal(r0["student_reloaded"][k], before1[k])   # save/load on the 2-D mesh
        assert torch.equal(r1["student_reloaded"][k], before1[k])


def test_learning(runs):
    for r in [runs["one"], runs["two"][0]]:
        rewards = r["rewards"]
        assert rewards[-1] > rewards[0] + 0.2, rewards
        assert r["unchanged"] == []   # every trained parameter moved
    assert runs["two"][0]["rewards"] == runs["two"][1]["rewards"]


TINY_MODEL = r"""
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers

path = sys.argv[1]   # a tiny Llama whose word-level vocabulary decodes any id it samples
vocab = {f"w{i}": i for i in range(64)}
tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1",
                        unk_token="w2").save_pretrained(path)
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                             tie_word_embeddings=True, bos_token_id=0,
                             eos_token_id=1)).save_pretrained(path)
"""


HANG = """
import sys, time
sys.path.insert(0, sys.argv[1])
import torch, torch.distributed as dist
import launch, rloo
def main():
    rloo.init_distributed(timeout_min=0.05)   # 3 s
    if dist.get_rank() == 1:
        time.sleep(10)   # a rank that hangs (past the timeout)
    dist.all_reduce(torch.zeros(1))
launch.main("hang.py", main)
"""


def test_a_hung_rank_ends_the_job_naming_the_collective(tmp_path):
    """rloo.init_distributed's timeout applies to the collectives; the rank that waited prints
    which collective timed out and why (launch.main), and the job ends long before the hang does"""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(script), ROOT], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "in main\n[rank 0]     dist.all_reduce(" in p.stderr, p.stderr[-3000:]
    assert "[rank 0] hang.py: a collective (named above) waited longer than " \
           "rloo.COLLECTIVE_TIMEOUT_MIN" in p.stderr, p.stderr[-3000:]
    assert rloo.COLLECTIVE_TIMEOUT_MIN >= 60   # not torch's default 10 minutes


def test_rloo_stands_alone_and_its_example_runs_as_written(tmp_path):
    """rloo.py copied alone into an empty folder, and the example of its docstring run there, as
    written, on one process: a tiny model at its path (my/model) and its toy reward. It trains:
    each of its 10 steps prints its reward and loss."""
    import shutil
    import textwrap
    shutil.copy(os.path.join(ROOT, "rloo.py"), tmp_path)
    lines = rloo.__doc__.split("\n\n    import rloo")[1].split("\nLayout")[0]
    example = textwrap.dedent("    import rloo" + lines)
    (tmp_path / "example.py").write_text(example)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", TINY_MODEL, "my/model"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = re.findall(r"step (\d+): reward ([\d.]+), loss (-?[\d.]+)", p.stdout)
    assert [int(s) for s, _, _ in steps] == list(range(10)), p.stdout[-3000:]


def test_data_stands_alone(tmp_path):
    """data.py copied alone: it grades with math-verify in its worker pool there"""
    import shutil
    shutil.copy(os.path.join(ROOT, "data.py"), tmp_path)
    code = ("import data; print('GRADES', data.grade(['so \\\\boxed{1/2}', 'x'], ['0.5', '2']))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "GRADES [120.0, 0.0]" in p.stdout, p.stdout
