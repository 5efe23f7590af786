"""Time per training step of the tinker backend's two loss paths, against a real Tinker-API server.

    python benchmarks/tinker_paths.py [--steps 5] [--losses cispo,dapo,importance_sampling] [--url URL]

Starts skyrl 0.3.0 on 127.0.0.1 from the integration tests' cached virtualenvs (built on first
use; tests/integration/tinker_server.py) unless --url names a running one, then, in the
tinker==0.24.1 client venv, trains one adapter per path on the same datums: the built-in path (one
forward_backward of the service's own loss) and the custom path (a forward, the loss here, then a
forward_backward of its gradient). Steps are off-policy (an anchor apart from the policy), as the
built-in path needs on a sequence_mean service; the first step of each path (JAX compilation) is
not timed. Prints seconds per step (forward/backward + optimizer step) and the custom/built-in ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def client_main(url: str, losses: list[str], steps: int) -> dict:
    """In the client venv: per loss, seconds of every timed step of each path."""
    import tinker
    import torch

    from tests.integration.test_tinker import MAPPED, _datums, _trainer
    from tests.plugins.backends.tinker_losses import step_loss as make_step_loss

    adam = tinker.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    out = {}
    for loss in losses:
        plugin_options = {"loss": {loss: MAPPED[loss]}}
        times = {}
        for label in ("builtin", "custom"):
            trainer, _ = _trainer(url, loss=[loss], plugin_options=plugin_options, seed=3)
            if label == "custom":
                trainer.builtin = None
            pairs = _datums(trainer.tokenizer, 16)
            datums = [d for _, d in pairs]
            generator = torch.Generator().manual_seed(0)
            seconds = []
            for step in range(steps + 1):
                before = trainer.forward(datums)  # the anchor: not part of either path's step
                advantages = [torch.randn(1, generator=generator).expand(len(lp)).clone() for lp in before]
                old = [lp + 0.1 * torch.randn(len(lp), generator=generator) for lp in before]
                step_loss = make_step_loss([loss], plugin_options, pairs, advantages, old)
                started = time.perf_counter()
                trainer.forward_backward_custom(datums, step_loss)
                trainer.optim_step(adam)
                if step:  # the first step compiles
                    seconds.append(time.perf_counter() - started)
            times[label] = seconds
        out[loss] = times
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per path and loss (after one untimed)")
    parser.add_argument("--losses", default="cispo,dapo,importance_sampling")
    parser.add_argument("--url", default="", help="a running skyrl server (default: start one)")
    parser.add_argument("--client", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    losses = args.losses.split(",")
    if args.client:
        print(json.dumps(client_main(args.client, losses, args.steps)))
        return

    from tests.integration.tinker_server import TinkerServer, client_env, ensure_client_venv, ensure_server_venv

    client_python = ensure_client_venv()
    server = None
    url = args.url
    with tempfile.TemporaryDirectory() as tmp:
        if not url:
            ensure_server_venv()
            server = TinkerServer(
                ROOT / "core" / "assets" / "default", Path(tmp) / "skyrl", max_lora_adapters=32, sample_max_num_sequences=32
            )
            print(f"skyrl started in {server.start():.1f}s", flush=True)
            url = server.url
        try:
            out = subprocess.run(
                [str(client_python), __file__, "--client", url, "--losses", args.losses, "--steps", str(args.steps)],
                capture_output=True, text=True, env=client_env(Path(tmp) / "client"), check=False,
            )  # fmt: skip
        finally:
            if server is not None:
                server.stop()
    if out.returncode:
        sys.exit(f"the client failed:\n{out.stderr[-4000:]}")
    results = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nseconds per step (median of {args.steps}, 16 sequences, skyrl 0.3.0 on this machine's CPU)")
    print(f"{'loss':<22}{'built-in':>10}{'custom':>10}{'custom / built-in':>20}")
    for loss, times in results.items():
        builtin, custom = statistics.median(times["builtin"]), statistics.median(times["custom"])
        print(f"{loss:<22}{builtin:>10.3f}{custom:>10.3f}{custom / builtin:>20.2f}")


if __name__ == "__main__":
    main()
