"""The tinker suite's client runs this checkout from a folder of links; every installed package must be there."""

import subprocess
import sys

import pytest

from tests.integration.tinker_server import client_env


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: ~10 s
def test_the_client_path_imports_every_package_the_wheel_installs(tmp_path):
    env = client_env(tmp_path / "client")
    code = (
        "import grpo_core, grpo_core.engine.models, grpo_core.plugins.backends.local, grpo_core.plugins.samplers.local;"
        "print(grpo_core.engine.models.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(tmp_path / "client" / "grpo_core" / "engine")), out.stdout
