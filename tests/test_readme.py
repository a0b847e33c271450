"""The README's commands work as written: every command line of its code blocks, run by bash as the
block sets its variables and loops, parses with the script's own parser; and its cheapest chain
(a SOAR run, a row with options after the sub-command, the report) runs on the small world."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

import data
import eval as ev
import soar
from soar_runs import ROOT, rows

# what bash finds in place of the real commands: each one writes its argv as a JSON line to $LOG
RECORDER = "#!{python}\nimport json, os, sys\nwith open(os.environ['LOG'], 'a') as f:\n" \
           "    f.write(json.dumps([{name!r}] + sys.argv[1:]) + '\\n')\n"


def bench_parser():
    spec = importlib.util.spec_from_file_location("bench_rloo",
                                                  os.path.join(ROOT, "bench", "bench_rloo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parser()


SCRIPTS = {"soar.py": soar.parse_args, "eval.py": ev.parse_args, "data.py": data.parse_args,
           "bench/bench_rloo.py": lambda argv: bench_parser().parse_args(argv)}


def readme_blocks() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"^```(?:bash|sh)\n(.*?)^```", text, re.M | re.S)


def recorded(block: str, tmp_path) -> list[list[str]]:
    """the command lines bash runs for `block`, each as its argv, with run.sh, python,
    .venv/bin/python and torchrun recording instead of running; PATH holds nothing else, so any
    other command fails"""
    bin_ = tmp_path / "bin"
    for path, name in ((bin_ / "python", "python"), (bin_ / "torchrun", "torchrun"),
                       (tmp_path / "run.sh", "./run.sh"),
                       (tmp_path / ".venv" / "bin" / "python", "python")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(RECORDER.format(python=sys.executable, name=name))
        path.chmod(0o755)
    log = tmp_path / "log.jsonl"
    log.unlink(missing_ok=True)
    p = subprocess.run(["/bin/bash", "-euc", block], cwd=tmp_path, capture_output=True, text=True,
                       env={"PATH": str(bin_), "LOG": str(log), "HEAD": "node0"}, timeout=120)
    assert p.returncode == 0 and not p.stderr, f"bash on the README block:\n{block}\n{p.stderr}"
    return rows(log) if log.exists() else []


def check(argv: list[str]) -> str:
    """parse one recorded command line with the parsers its programs use; returns the script it
    runs"""
    prog, args = argv[0], argv[1:]
    if prog == "./run.sh":
        if args[:1] == ["test"]:
            return "run.sh test"
        prog, args = "soar.py", args            # ./run.sh [soar.py flags]
    elif prog == "torchrun":
        a = get_args_parser().parse_args(args)
        prog, args = a.training_script, a.training_script_args
    elif prog == "python":
        prog, args = args[0], args[1:]
    if prog not in SCRIPTS:
        raise AssertionError(f"the README runs {prog}, which this test does not know")
    SCRIPTS[prog](args)
    return prog


def test_every_readme_command_parses(tmp_path):
    lines = [argv for block in readme_blocks() for argv in recorded(block, tmp_path)]
    failed, scripts = [], set()
    for argv in lines:
        try:
            scripts.add(check(argv))
        except SystemExit as e:      # argparse's error (exit 2), or the script's own p.error
            failed.append(f"{' '.join(argv)}  (exit {e.code})")
    assert not failed, "README commands that do not parse:\n" + "\n".join(failed)
    assert scripts >= {"run.sh test", "soar.py", "eval.py", "data.py",
                       "bench/bench_rloo.py"}, scripts
    assert any(a[0] == "torchrun" for a in lines) and len(lines) >= 20   # loops ran: 3 seeds each


def test_sbatch_runs_one_torchrun_per_node_meeting_on_the_first(tmp_path):
    """soar.sbatch as a 2-node job of 8 GPUs each, SLURM's commands stood in for: scontrol names the
    nodes, srun runs its command (once here; on a cluster once per node), ./run.sh and torchrun
    record their argv"""
    bin_ = tmp_path / "bin"
    for path, name in ((tmp_path / "run.sh", "./run.sh"), (tmp_path / ".venv/bin/torchrun",
                                                           "torchrun"), (bin_ / "srun", "srun")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(RECORDER.format(python=sys.executable, name=name) + (
            "os.execv(sys.argv[2], sys.argv[2:])\n" if name == "srun" else ""))
        path.chmod(0o755)
    (bin_ / "scontrol").write_text("#!/bin/sh\nprintf 'node0\\nnode1\\n'\n")
    (bin_ / "scontrol").chmod(0o755)
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "LOG": str(tmp_path / "log.jsonl"),
           "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "node[0-1]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "7"}
    p = subprocess.run(["/bin/bash", os.path.join(ROOT, "soar.sbatch"), "--out", "runs/x",
                        "--outer_steps", "4"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    setup, srun, torchrun = rows(tmp_path / "log.jsonl")
    assert setup == ["./run.sh", "setup"] and srun[0] == "srun"
    a = get_args_parser().parse_args(torchrun[1:])
    assert (a.nnodes, a.nproc_per_node, a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id) == \
        ("2", "8", "c10d", "node0:29500", "7")
    assert a.training_script == "soar.py" and \
        soar.parse_args(a.training_script_args).outer_steps == 4
    assert "job 7 (restart 0) on 2 node(s), 8 rank(s) each, rendezvous node0:29500" in p.stdout


def test_recording_sees_what_bash_expands(tmp_path):
    """the block's variables and loops are bash's: $E and $s expand as the block sets them"""
    block = 'E=".venv/bin/python eval.py row --runs r"\nfor s in 0 1; do $E pq --seeds $s; done\n'
    assert recorded(block, tmp_path) == [["python", "eval.py", "row", "--runs", "r", "pq",
                                          "--seeds", str(s)] for s in (0, 1)]
    with pytest.raises(AssertionError, match="not found"):
        recorded("rm -rf /tmp/nothing-here\n", tmp_path)


def test_options_anywhere():
    for argv in (["row", "--runs", "r", "base", "hard-only", "--seeds", "0"],
                 ["--runs", "r", "row", "base", "--seeds", "0", "hard-only"],
                 ["row", "base", "hard-only", "--runs", "r", "--seeds", "0"]):
        cmd, args, cfg = ev.parse_args(argv)
        assert (cmd, args, cfg.runs, cfg.seeds) == ("row", ["base", "hard-only"], "r", "0")
    assert data.parse_args(["math", "out.jsonl"]).source == "math"
    with pytest.raises(SystemExit):
        data.parse_args(["math"])


def test_cheapest_chain_end_to_end(full_run, tmp_path):
    """after a SOAR run (the session's reference run, which promotes), `eval.py row` with its
    options after the sub-command and between the rows, then `eval.py report`, as the README chains
    them"""
    from test_eval import SMALL, eval_py
    out, _ = full_run
    runs = tmp_path / "runs"
    p = eval_py("row", "--runs", str(runs), "ps", "--soar", str(out), "pq", *SMALL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for method in ("ps", "pq"):
        res = json.loads((runs / method / "seed0" / "result.json").read_text())
        assert res["method"] == method and \
            0 <= res["passk"]["pass@1"] <= res["passk"]["pass@8"] <= 1
    assert rows(runs / "pq" / "seed0" / "metrics.jsonl")   # a fresh student trained on the run's PQ
    q = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "report", "--runs",
                        str(runs), "--soar", str(out), "--vendi_subset", "8", "--vendi_draws", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert q.returncode == 0, q.stderr[-3000:]
    report = (runs / "report.md").read_text()
    assert all(f"| {m} | " in report for m in ("ps", "pq")) and f"- {out}: 3 outer steps" in report
