import os
import sys

import pytest

os.environ["WANDB_MODE"] = "offline"   # a test never reaches W&B's servers (nor needs a login)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soar_runs import LORA, soar  # noqa: E402


@pytest.fixture(scope="session")
def full_run(tmp_path_factory):
    """the reference: an uninterrupted SOAR run (soar_runs.FLAGS), for the outputs test and as what
    every interrupted run must end up equal to"""
    out = tmp_path_factory.mktemp("soar") / "a"
    p = soar(out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory):
    """a LoRA SOAR run to the end (soar_runs.FLAGS, LORA): what test_soar_e2e's killed LoRA run
    must end up equal to, and the LoRA run whose PEFT folders test_eval's rows read"""
    out = tmp_path_factory.mktemp("lora") / "whole"
    p = soar(out, *LORA)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p
