"""The README's fork recipes ("Trying your own idea: one place each"): its four diffs (another
student loss, a teacher reward from per-question outcomes, a promotion rule, an exact-match task)
applied together to a copy of the repository with `git apply`, and that copy run for two steps on
the small world, rebuilt for the new checker: one launch for the four. A recipe that stops applying
or running fails here. The fifth, rloo.py copied alone, is test_rloo's
test_rloo_stands_alone_and_its_example_runs_as_written."""
import json
import os
import re
import shutil
import subprocess
import sys

from soar_runs import FLAGS, ROOT, rows

RECIPES = ("Students that learn with another loss", "A teacher reward from per-question outcomes",
           "A promotion rule", "Another task or checker")


def recipes() -> dict[str, str]:
    """each recipe's diff, by the bold words that name it in the README"""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    found = re.findall(r"\n\*\*([^*\n]+)\*\*(?:(?!\n\*\*|```).)*```diff\n(.*?)```", text, re.S)
    return {name: diff for name, diff in found}


def repository_copy(folder) -> str:
    """the repository's tracked files (and the shipped worlds) copied into folder"""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for f in files:
        os.makedirs(os.path.join(folder, os.path.dirname(f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(folder, f))
    return str(folder)


def test_the_readmes_fork_recipes_apply_and_run(tmp_path):
    diffs = recipes()
    assert list(diffs) == list(RECIPES)
    repo = repository_copy(tmp_path / "fork")
    for name, diff in diffs.items():
        patch = tmp_path / "recipe.diff"
        patch.write_text(diff)
        p = subprocess.run(["git", "apply", str(patch)], cwd=repo, capture_output=True, text=True)
        assert p.returncode == 0, f"README recipe {name!r} does not apply: {p.stderr}"
    # the exact-match checker is data.py's: grading, the teacher's format filter and load_problems
    # use it (math-verify cannot parse "}{" as a gold answer: the math task drops that problem)
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"question": "Q?", "answer": "}{"}) + "\n")
    check = ("import json, sys, data; print(json.dumps([data.grade(['\\\\boxed{1/2}', "
             "'\\\\boxed{ 7 }'], ['0.5', '7']), data.parse_teacher_batch(['<question>Q?</question>"
             "<answer>\\\\boxed{a b}</answer>']), data.load_problems(sys.argv[1])]))")
    p = subprocess.run([sys.executable, "-c", check, str(problems)], cwd=repo, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    graded, pairs, kept = json.loads(p.stdout)
    assert graded == [10.0, 120.0] and pairs == [["Q?", "a b"]]   # 1/2 is not 0.5 by text
    assert kept == [{"question": "Q?", "answer": "}{"}]
    # the task's code is in the world's key: the shipped small world is rebuilt for it
    p = subprocess.run([sys.executable, "world.py", "--ship", "--small"], cwd=repo,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    flags = [f for f in FLAGS if f != "--promote_every_step"]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "soar.py", "--out", str(out), *flags, "--outer_steps", "2", "--tau", "-1", "--reward",
           "newly_solved"]
    p = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = rows(out / "metrics.jsonl")
    assert len(metrics) == 2
    for m in metrics:
        assert all(0 <= x <= 1 for row in m["R"] for x in row)   # a share of Q_R
        assert m["promoted"] == (max(m["R_k"]) > 0)              # MA > -1 always: R_k* > 0 decides
        assert m["tokens/trained/student_training"] > 0
