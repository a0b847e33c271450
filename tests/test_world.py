"""The built-in world (world.py): the problem generator's answers, the reader of teacher questions,
and the small world that ships measured with the real engine, so that a regression in the formats
(prompts, chat template, parser, grader) shows up as a rate falling below its bar; and its rebuild
is the same world whatever the caller's threads."""
import json
import os
import random
import subprocess
import sys

import pytest

import data
import launch
import world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVELS = [("add", 1), ("sub", 1)] + \
    [("word", s) for s in ("+", "-", "f", "+-", "--+", "-f+f", "----", "?3")]


def test_generator_answers_verify():
    rng = random.Random(0)
    for kind, level in LEVELS:
        for _ in range(8):
            p = world.make_problem(rng, kind, level)
            c = world.classify(p["question"])
            assert c is not None and c["answer"] == p["answer"] and c["kind"] == kind
            assert int(p["answer"]) >= 1
            # the formats the model is trained on grade and parse as intended
            assert data.grade([world.student_solution(p)] * 2,
                              [p["answer"], str(int(p["answer"]) + 1)]) == \
                [data.R_CORRECT, data.R_BOXED]
            assert data.parse_teacher_batch([world.teacher_reply(p)]) == \
                [(p["question"], p["answer"])]
            if set(p["signs"]) & set("-f") and kind == "word":   # a misread step changes the answer
                i = min(p["signs"].find(c) for c in "-f" if c in p["signs"])
                assert data.grade([world.student_solution(p, {i})], [p["answer"]]) != \
                    [data.R_CORRECT]


def test_classify_rejects_what_is_not_the_family():
    assert world.classify("What is 3 * 4?") is None
    assert world.classify("Tom has 5 apples. He eats 2. How many apples does he have now?") is None
    assert world.classify("Tom has 5 apples. He gives away 2, then gets 3 more. How many apples "
                          "does he have now?") == dict(kind="word", level="-+", answer="6")


def test_describe_reads_what_the_teacher_wrote():
    q = "Tom has 5 apples. He gives away 2, then gets 3 more. How many apples does he have now?"
    assert world.describe(q, "6") == dict(well_posed=True, kind="word", steps=2, gives_away=1,
                                          category="word, with 'gives away'", correct=True)
    assert world.describe(q, "10")["correct"] is False and \
        world.describe(q, "10")["well_posed"] is True
    assert world.describe("What is 12 - 3?", " 9 ")["category"] == "bare sum"
    bad = world.describe("What is 3 * 4?", "12")
    assert not bad["well_posed"] and not bad["correct"] and bad["category"] == world.CATEGORIES[0]
    assert set(world.USEFUL) <= set(world.CATEGORIES)


def test_the_cache_key_follows_the_grader(monkeypatch):
    """a world's hard set is what data.solved never solves: another grader (its code or its
    constants) is another key, so a cached world is not reused with it"""
    key = world.build_key(small=True, seed=0)
    assert world.build_key(small=True, seed=0) == key

    def last_boxed(text):   # a fork's extraction: the first box, not the last
        start = text.find("\\boxed{")
        return None if start < 0 else text[start + 7:].split("}")[0]

    with monkeypatch.context() as m:
        m.setattr(data, "last_boxed", last_boxed)
        assert world.build_key(small=True, seed=0) != key
    with monkeypatch.context() as m:
        m.setattr(data, "R_CORRECT", 1.0)
        assert world.build_key(small=True, seed=0) != key
    assert world.build_key(small=True, seed=0) == key


def test_unfinished_folder_is_not_a_world(tmp_path):
    # e.g. a crash mid-build under the final name (cannot happen: tmp + rename)
    (tmp_path / "w").mkdir()
    with pytest.raises(FileExistsError):
        world.build_world(out_dir=str(tmp_path / "w"), small=True)


@pytest.fixture(scope="module")
def small_world():
    """the small world that ships (worlds/small), the one the end-to-end tests use, checked against
    world.py's recipe; built again below in another process with other threads"""
    return world.build_world(small=True)


def test_small_world_rates(small_world):
    with open(small_world["stats"]) as f:
        st = json.load(f)
    assert st["teacher"]["valid_pair_rate"] >= 0.5, st
    # the hard set: exactly the candidates with 0 correct of k on the filter's own samples, at least
    # `need` problems in each half
    counts, r = st["candidate_correct_counts"], st["recipe"]
    assert len(counts) == st["candidates"] and all(0 <= c <= r["k"] for c in counts)
    train, test = data.load_problems(small_world["train"]), data.load_problems(small_world["test"])
    assert len(train) + len(test) == sum(c == 0 for c in counts) == st["hard"]
    assert min(len(train), len(test)) >= r["need"] and abs(len(train) - len(test)) <= 1
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    assert st["fingerprint"] == world.fingerprint(train, test)


def test_small_world_model_folder(small_world):
    from transformers import AutoConfig, AutoTokenizer
    model = small_world["model"]
    assert os.path.exists(os.path.join(model, "model.safetensors"))
    cfg = AutoConfig.from_pretrained(model)
    assert cfg.model_type == "llama" and cfg.head_dim == 64
    tok = AutoTokenizer.from_pretrained(model)
    prompt = data.teacher_prompt(tok)  # the chat template is there and renders the teacher prompt
    assert data.TEACHER_PROMPT in tok.decode(prompt) and tok.eos_token and tok.pad_token
    # same ids with or without special tokens: nothing is added behind the caller's back
    text = tok.decode(prompt)
    assert tok(text)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"] == prompt
    # the engines' context holds a teacher prompt + reply and a student prompt + completion
    q = world.make_problem(random.Random(0), "word", "----")["question"]
    n = data.engine_len(tok, [q], student_max_tokens=world.MAX_TOKENS,
                        teacher_max_tokens=world.MAX_TOKENS)
    assert n >= len(prompt) + world.MAX_TOKENS
    assert n >= len(tok(data.student_prompt(q))["input_ids"]) + world.MAX_TOKENS
    assert n <= world.MAX_MODEL_LEN


def test_small_world_is_reused(small_world):
    mtime = os.path.getmtime(small_world["stats"])
    again = world.build_world(out_dir=os.path.dirname(small_world["stats"]), small=True)
    assert again == small_world and os.path.getmtime(again["stats"]) == mtime


def test_the_world_ships_again_the_same_whatever_the_threads(small_world, tmp_path):
    """`world.py --ship --small` (on a copy of worlds/) in a process with other thread settings
    (OMP_NUM_THREADS=2) rebuilds the world that ships: same hard set (fingerprint), same filter
    counts, and says so. On a host whose CPU builds another world (docs/world.md), it must say
    that, and build what this host builds with the caller's threads."""
    import shutil
    shutil.copytree(os.path.dirname(small_world["stats"]), tmp_path / "worlds" / "small")

    def build(**env):
        env = {**os.environ, **env}
        env.pop("ATEN_CPU_CAPABILITY", None)
        code = f"import world; world.SHIPPED = {str(tmp_path / 'worlds')!r}; world.ship(True)"
        p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=900)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        with open(tmp_path / "worlds" / "small" / "stats.json") as f:
            stats = json.load(f)
        assert f"rebuilt, fingerprint {stats['fingerprint']}" in p.stdout
        return (stats["fingerprint"], stats["candidate_correct_counts"]), p.stdout
    with open(small_world["stats"]) as f:
        shipped = json.load(f)
    threads, said = build(OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
    if threads == (shipped["fingerprint"], shipped["candidate_correct_counts"]):
        assert "the same hard set as what shipped before" in said
    else:
        assert "another hard set than what shipped before" in said
        assert threads == build()[0]   # this host's own world, whatever the threads


def test_a_changed_recipe_is_refused_until_the_worlds_ship_again(monkeypatch):
    """the worlds that ship are checked against world.py's recipe: after a change to it, a run
    stops in one line that names the command rebuilding them"""
    monkeypatch.setattr(world, "VERSION", world.VERSION + 1)
    with pytest.raises(launch.UsageError, match=r"rebuild it with `python world\.py --ship "
                                                r"--small`$"):
        world.build_world(small=True)


def test_an_edited_build_function_is_refused_until_the_worlds_ship_again(monkeypatch, tmp_path):
    """the key covers world.py's build code (world.build_code), not only its recipe and VERSION: a
    copy of world.py whose make_problem draws otherwise is refused; one whose edit is a docstring,
    a comment or a function that only prints (summary) is not"""
    with open(world.__file__) as f:
        source = f.read()
    assert source.count("def make_problem(") == 1
    edits = {
        "build": source.replace("def make_problem(rng: random.Random, kind: str, level, "
                                "steps=(1, 1, 1)) -> dict:\n",
                                "def make_problem(rng: random.Random, kind: str, level, "
                                "steps=(1, 1, 1)) -> dict:\n    rng.random()\n"),
        "docstring": source.replace('"""The built-in small world', '"""The small built-in world'),
        "comment": source.replace("# the problem family", "# the family of problems"),
        "summary": source.replace("def summary(paths: dict) -> str:\n",
                                  "def summary(paths: dict) -> str:\n    print()\n"),
    }
    for name, edited in edits.items():
        assert edited != source, name
        path = tmp_path / f"{name}.py"
        path.write_text(edited)
        monkeypatch.setattr(world, "__file__", str(path))
        if name == "build":
            with pytest.raises(launch.UsageError, match=r"another recipe or build code"):
                world.build_world(small=True)
        else:
            assert world.build_world(small=True) == world._paths(
                os.path.join(world.SHIPPED, "small")), name


def test_a_shipped_world_whose_files_changed_is_refused(monkeypatch, tmp_path):
    """at load the shipped files are checked against the sha256 each had when built (stats.json)
    and the hard set against its fingerprint: a changed weight file or hard split is named"""
    import shutil
    shutil.copytree(os.path.join(world.SHIPPED, "small"), tmp_path / "small")
    monkeypatch.setattr(world, "SHIPPED", str(tmp_path))
    assert world.build_world(small=True)["model"] == str(tmp_path / "small" / "model")
    weights = tmp_path / "small" / "model" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    with pytest.raises(launch.UsageError, match=r"files changed since it was built "
                                                r"\(model/model\.safetensors; hard set"):
        world.build_world(small=True)
    blob[-1] ^= 1
    weights.write_bytes(bytes(blob))
    with open(tmp_path / "small" / "test.jsonl", "a") as f:
        f.write(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    with pytest.raises(launch.UsageError, match=r"files changed since it was built \(test\.jsonl"):
        world.build_world(small=True)
