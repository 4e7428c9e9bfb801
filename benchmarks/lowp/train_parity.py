"""Training parity: the demo model trained the same seeded steps on the same data in every precision.

Run: ``python benchmarks/lowp/train_parity.py [--steps 300] [--only fp32,bf16,...] [--png docs/lowp_training_parity.png]
[--json out.json]``

Configurations (torchnext.demo.model; fp32 master weights and AdamW state in all of them):

* ``fp32``, ``bf16`` (every projection, expert and the head computed in bf16);
* ``mxfp8``, ``nvfp4``: the published recipes on block 0, block 1 and the head in bf16 (bf16_tail_filter);
* ablations of ``nvfp4``: ``nvfp4_no_rht``, ``nvfp4_no_sr``, ``nvfp4_no_2d`` (1 x 16 weight blocks), and
  ``nvfp4_all_layers`` (every linear layer in NVFP4: head and routers included, no bf16 tail).

Same initial weights (the conversion draws no torch randomness), same batches (``batch_for_step``), one thread.
Reported per configuration: the loss of the last step and the mean over the last 20 steps (the figure compared,
less noisy), and its gap to bf16 in percent; with ``--seeds N`` every configuration runs N seeds (initial weights,
data and stochastic-rounding streams) and the gap is averaged per seed, with its range. The PNG shows every loss
curve of the first seed (an exponential moving average, 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from torchnext.demo.data import VOCAB, batch_for_step
from torchnext.demo.model import ModelConfig, MoETransformerLM, Precision
from torchnext.lowp import Recipe

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": Precision.FP32},
    "bf16": {"precision": Precision.BF16},
    "mxfp8": {"precision": Precision.MXFP8},
    "nvfp4": {"precision": Precision.NVFP4},
    "nvfp4_no_rht": {"precision": Precision.NVFP4, "lowp_recipe": Recipe.NVFP4.with_(rht=False).key},
    "nvfp4_no_sr": {"precision": Precision.NVFP4, "lowp_recipe": Recipe.NVFP4.with_(stochastic_rounding=False).key},
    "nvfp4_no_2d": {"precision": Precision.NVFP4, "lowp_recipe": Recipe.NVFP4.with_(weight_2d=False).key},
    "nvfp4_all_layers": {"precision": Precision.NVFP4, "lowp_all_layers": True},
}
TAIL = 20


def train(name: str, steps: int, batch_size: int, seq_len: int, lr: float, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = MoETransformerLM(ModelConfig(vocab_size=len(VOCAB), max_seq_len=max(128, seq_len), lowp_seed=seed,
                                         **CONFIGS[name]))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = batch_for_step(step, seed=seed, shard=0, num_shards=1, batch_size=batch_size, seq_len=seq_len)
        loss, lm = model.loss(x, y, step=step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(lm)
    wall = time.perf_counter() - t0
    tail = sum(losses[-TAIL:]) / min(TAIL, len(losses))
    return {"name": name, "losses": losses, "final": losses[-1], "tail_mean": tail, "wall_s": wall,
            "lowp_layers": model.lowp_layers}


def ema(xs: list[float], a: float = 0.9) -> list[float]:
    out, m = [], xs[0]
    for x in xs:
        m = a * m + (1 - a) * x
        out.append(m)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1, help="seeds per configuration (seed .. seed + seeds - 1)")
    ap.add_argument("--only", default=None, help="comma-separated configurations (default: all)")
    ap.add_argument("--png", default=None, help="write the loss curves here (needs matplotlib)")
    ap.add_argument("--json", default=None, help="write every loss here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"1 torch thread; load average {os.getloadavg()[0]:.2f}")
    print(f"demo model (d_model 64, 2 blocks, 4 experts), {args.steps} steps, batch {args.batch_size} x {args.seq_len} "
          f"chars, AdamW lr {args.lr}, seed {args.seed}")
    results = []
    seeds = list(range(args.seed, args.seed + args.seeds))
    for name in names:
        runs = [train(name, args.steps, args.batch_size, args.seq_len, args.lr, sd) for sd in seeds]
        r = dict(runs[0])
        r["tail_means"] = [x["tail_mean"] for x in runs]
        r["tail_mean"] = sum(r["tail_means"]) / len(runs)
        r["finals"] = [x["final"] for x in runs]
        r["wall_s"] = sum(x["wall_s"] for x in runs)
        results.append(r)
        print(f"  {name:<17} final {r['final']:.4f}  mean(last {TAIL}) per seed "
              f"{' '.join(f'{v:.4f}' for v in r['tail_means'])}  {r['wall_s']:.0f} s"
              f"  low-precision layers: {len(r['lowp_layers'])}", flush=True)
    base = next((r for r in results if r["name"] == "bf16"), None)
    print(f"\n| configuration | loss, last step (seed {args.seed}) | mean loss, last {TAIL} steps"
          f"{' (mean of ' + str(len(seeds)) + ' seeds)' if len(seeds) > 1 else ''} | gap to bf16 | gap range over seeds |"
          " low-precision layers |")
    print("|---|---|---|---|---|---|")
    for r in results:
        if base is not None:
            gaps = [100 * (v - b) / b for v, b in zip(r["tail_means"], base["tail_means"], strict=True)]
            r["gap_to_bf16_pct"] = sum(gaps) / len(gaps)
            gap, spread = f"{r['gap_to_bf16_pct']:+.2f} %", f"{min(gaps):+.2f} .. {max(gaps):+.2f} %"
        else:
            gap = spread = "n/a"
        print(f"| {r['name']} | {r['final']:.4f} | {r['tail_mean']:.4f} | {gap} | {spread} | {len(r['lowp_layers'])} |")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
        start = 2 * len(results[0]["losses"]) // 3
        for r in results:
            curve = ema(r["losses"])
            ax.plot(curve, label=r["name"], linewidth=1.2)
            zoom.plot(range(start, len(curve)), curve[start:], label=r["name"], linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("LM loss (nats/char, EMA 0.9)")
        ax.set_title(f"demo model, {args.steps} seeded steps per precision (seed {args.seed})", fontsize=10)
        ax.set_ylim(top=min(4.0, max(ema(r["losses"])[5] for r in results)))
        zoom.set_title(f"the last third (steps {start}-{args.steps})", fontsize=10)
        zoom.set_xlabel("step")
        zoom.legend(fontsize=8)
        for a in (ax, zoom):
            a.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
