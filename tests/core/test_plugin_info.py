from __future__ import annotations

import json
import subprocess
import sys

import attrs
import pytest

from grpo_core import option, plugin_info
from grpo_core.plugin_info import describe_all, render
from grpo_core.plugins_manager import PluginEntry
from tests.helpers import grpo_core_in_process, make_plugin_package, small_run_args


@attrs.define
class Hookless:
    """A loss without its hook."""

    scale: float = option(1.0, help="scale")
    api_key: str = option("", help="key of the service")

    def loss(self, inputs):
        return self.scale


def test_describe_all_flags_problems_and_secret_options(monkeypatch, capsys):
    entry = PluginEntry("loss", "hookless", "tests.core.test_plugin_info:Hookless", "grpo-loss-x", "0.2")
    monkeypatch.setattr(plugin_info, "catalog", lambda: (entry,))
    (info,) = describe_all()
    assert info["problems"] == ["a loss plugin must implement @hookimpl def loss(self, inputs) (missing: loss)"]
    assert [(o["name"], o["secret"]) for o in info["options"]] == [("scale", False), ("api_key", True)]
    render([info])
    out = capsys.readouterr().out
    assert "loss hookless  (grpo-loss-x 0.2)  hooks: none  INVALID" in out
    assert "!!  a loss plugin must implement @hookimpl def loss(self, inputs) (missing: loss)" in out
    assert "api_key='' key of the service (secret: not written to config.json; env:NAME reads a variable)" in " ".join(out.split())
    assert "scale=1.0  scale\n" in out


BAD_PLUGINS = '''
import attrs
import pytest
from grpo_core import hookimpl, option

@attrs.define
class Misspelled:
    """Reward whose hook is misspelled."""

    @hookimpl
    def rewards(self, prompt, samples):
        return [1.0 for _ in samples]

@attrs.define
class WrongArgument:
    """Reward with a wrong argument name."""

    @hookimpl
    def reward(self, prompt, sample):
        return [1.0]

@attrs.define
class Hookless:
    """Loss without a loss hook."""

    def loss(self, inputs):
        return None

@attrs.define
class Vault:
    """Valid reward with a secret."""

    api_key: str = option("", help="service key")

    @hookimpl
    def reward(self, prompt, samples):
        return [1.0 if self.api_key == "sk-right" else 0.0 for _ in samples]
'''


@pytest.mark.slow
def test_invalid_plugins_are_listed_as_such_and_refused_by_run_before_the_model_loads(tiny_dataset, tmp_path):
    pkg = make_plugin_package(
        tmp_path,
        "grpo-bad-plugins",
        BAD_PLUGINS,
        {
            "reward.misspelled": "grpo_bad_plugins:Misspelled",
            "reward.wrongarg": "grpo_bad_plugins:WrongArgument",
            "loss.hookless": "grpo_bad_plugins:Hookless",
            "reward.vault": "grpo_bad_plugins:Vault",
        },
    )
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(pkg)],
        check=True,
        capture_output=True,
    )
    env = {"PYTHONPATH": str(target)}
    listing = grpo_core_in_process("plugins", env=env)
    assert listing.returncode == 0, listing.stderr
    assert "reward misspelled  (grpo-bad-plugins 1.2.3)  hooks: rewards  INVALID" in listing.stdout
    assert "!!  method 'rewards' is marked @hookimpl but no hook has that name (did you mean 'reward'?)" in listing.stdout
    assert "reward wrongarg  (grpo-bad-plugins 1.2.3)  hooks: reward  INVALID" in listing.stdout
    assert "loss hookless  (grpo-bad-plugins 1.2.3)  hooks: none  INVALID" in listing.stdout
    assert "reward vault  (grpo-bad-plugins 1.2.3)  hooks: reward\n" in listing.stdout
    assert "loss grpo  (grpo-core 0.1.0)  hooks: loss\n" in listing.stdout
    infos = {(i["kind"], i["name"]): i for i in json.loads(grpo_core_in_process("plugins", "--json", env=env).stdout)}
    assert infos[("reward", "wrongarg")]["problems"] == [
        "hookimpl definition: reward(self, prompt, sample); "
        "Argument(s) {'sample'} are declared in the hookimpl but can not be found in the hookspec"
    ]
    assert infos[("loss", "hookless")]["problems"] == ["a loss plugin must implement @hookimpl def loss(self, inputs) (missing: loss)"]
    assert infos[("reward", "vault")]["problems"] == [] and infos[("reward", "vault")]["options"][0]["secret"] is True
    assert all(i["problems"] == [] for i in infos.values() if i["distribution"] == "grpo-core")

    # A model that does not exist: an error about it would mean the plugin was checked too late.
    missing_model = "grpo-core-tests/no-such-model"  # a hub name: a missing folder would be refused before the plugins
    for extra, message in [
        (
            ["--reward", "misspelled"],
            "reward plugin 'misspelled' from grpo-bad-plugins 1.2.3 (grpo_bad_plugins:Misspelled) cannot be used: "
            "method 'rewards' is marked @hookimpl but no hook has that name (did you mean 'reward'?)",
        ),
        (
            ["--reward", "wrongarg"],
            "reward plugin 'wrongarg' from grpo-bad-plugins 1.2.3 (grpo_bad_plugins:WrongArgument) cannot be used: "
            "hookimpl definition: reward(self, prompt, sample); Argument(s) {'sample'}",
        ),
        (
            ["--loss", "hookless"],
            "loss plugin 'hookless' from grpo-bad-plugins 1.2.3 (grpo_bad_plugins:Hookless) cannot be used: "
            "a loss plugin must implement @hookimpl def loss(self, inputs) (missing: loss)",
        ),
    ]:
        run_dir = tmp_path / "r"
        out = grpo_core_in_process(*small_run_args(missing_model, tiny_dataset, run_dir, *extra), env=env)
        assert out.returncode == 1, out.stderr
        assert message in out.stderr
        assert "Traceback" not in out.stderr and "cannot load model" not in out.stderr
        assert not run_dir.exists()
