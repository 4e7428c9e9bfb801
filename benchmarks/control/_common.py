"""What the control benchmarks share: the command line (``--quick``, ``--json``, ``--threads``) and the header."""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

import torchnext


def header() -> None:
    print(f"torchnext {torchnext.__version__}  torch {torch.__version__}  python {platform.python_version()}")
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"threads={torch.get_num_threads()}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  (shared machine: figures are noisy, compare ratios)")


def parse_args(description: str | None = None) -> argparse.Namespace:
    """Parse the shared options, set torch's intra-op threads, print the header."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (default 1: stable figures on a shared 2-core box)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    header()
    return args
