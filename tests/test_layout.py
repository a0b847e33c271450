"""The shape of the code: two libraries that stand alone (rloo.py, data.py), rloo_extras.py and
LoRA (lora.py) on rloo.py, launch.py and the built-in world on top of them, three scripts that
import only those; docs that stand on their own."""
import ast
import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = {"data", "launch", "rloo", "rloo_extras", "lora", "world", "soar", "eval", "populora"}
SCRIPTS = {"soar", "eval", "populora"}
# what each module may pull in, directly or through another one
EXTRAS = {"rloo", "rloo_extras", "lora"}
ALLOWED = {"data": {"data"}, "rloo": {"rloo"}, "rloo_extras": {"rloo_extras", "rloo"},
           "lora": EXTRAS, "launch": {"launch", "data"} | EXTRAS, "world": {"world", "data"},
           "soar": {"soar", "launch", "data", "world"} | EXTRAS,
           "eval": {"eval", "launch", "data", "world"} | EXTRAS,
           "populora": {"populora", "launch", "data", "world"} | EXTRAS}
# what the stand-alone libraries may import at all (their own file aside)
STANDALONE = {"rloo": {"torch", "transformers", "vllm", "numpy", "safetensors"},
              "data": {"numpy", "math_verify", "pyarrow", "huggingface_hub", "torch",
                       "transformers"}}


@pytest.mark.parametrize("module", sorted(OURS))
def test_imports_in_a_fresh_interpreter(module):
    code = (f"import json, sys, {module}; "
            f"print(json.dumps([m for m in sys.modules if m in {sorted(OURS)!r}]))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert set(json.loads(p.stdout)) <= ALLOWED[module]


@pytest.mark.parametrize("module", sorted(STANDALONE))
def test_the_libraries_import_nothing_of_ours(module):
    """rloo.py and data.py import only the standard library and their third-party packages (data.py
    imports torch and transformers only inside embed_hf, pyarrow and the hub client only to read
    their formats), at the top or inside a function"""
    tree = ast.parse(open(os.path.join(ROOT, module + ".py")).read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names)
    assert third_party <= STANDALONE[module], third_party - STANDALONE[module]


def test_nothing_imports_a_script():
    """not even inside a function (a lazy import is still a cycle)"""
    for path in glob.glob(os.path.join(ROOT, "*.py")) + \
            glob.glob(os.path.join(ROOT, "bench", "*.py")):
        for node in ast.walk(ast.parse(open(path).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            assert not SCRIPTS & set(names), f"{path} imports a script"


def docs_and_code():
    files = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "*", "*.py")) + \
        [os.path.join(ROOT, f) for f in ("README.md", "METHOD.md", "run.sh", "requirements.txt")]
    # this file quotes the patterns
    return {f: open(f).read() for f in files if not f.endswith("test_layout.py")}


def test_method_citations_name_sections_that_exist():
    sections = set(re.findall(r"^## (.+)$", open(os.path.join(ROOT, "METHOD.md")).read(), re.M))
    cited = {}
    for f, text in docs_and_code().items():
        for group in re.findall(r'METHOD\.md((?:,? ?"[^"\n]+")+)', text):
            for name in re.findall(r'"([^"]+)"', group):
                cited.setdefault(name, set()).add(os.path.basename(f))
    assert len(cited) >= 10
    assert {n: fs for n, fs in cited.items() if n not in sections} == {}


def test_nothing_refers_outside_the_repository():
    for f, text in docs_and_code().items():
        assert not re.search(r"SPEC\b|SPEC\.md|NOTES\.md|steering|shared/", text), f


def test_top_level_holds_the_design_card():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    top = {f.split("/")[0] for f in tracked if not f.startswith(".")}
    assert top == {"soar.py", "rloo.py", "rloo_extras.py", "launch.py", "data.py", "eval.py",
                   "world.py", "populora.py", "lora.py", "worlds", "README.md",
                   "METHOD.md", "requirements.txt", "run.sh", "soar.sbatch", "tests", "bench",
                   "docs", "pyproject.toml"}   # (soar.sbatch: run.sh's counterpart on SLURM)
