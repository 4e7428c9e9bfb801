"""One rank of the demo: fault-tolerant data-parallel training of the MoE language model.

Run by ``torchnext demo`` (which launches the ranks and hosts the coordinator), or by hand / torchrun against a
separately started coordinator::

    torchnext coordinator --host 127.0.0.1 --port 29400 &      # prints the job token to use
    TORCHNEXT_FT_COORDINATOR=127.0.0.1:29400 TORCHNEXT_FT_TOKEN=<token> \\
        torchrun --nproc-per-node 4 -m torchnext.demo.train --steps 60 --out ./torchnext-demo

Every process runs the same loop. A step is: forward/backward on this rank's data shard, one all_reduce (AVG) of
the flattened gradients through the fault-tolerant Communicator, a two-phase commit, then the optimizer step — only
when every current member finished the step. A member that dies makes the step fail on the survivors
(``PeerFailure``/``CommAborted``): the group reconfigures in place and the loop retries the step. Data sharding
follows the member's rank in the current generation, so the global batch stays deterministic per step.

Progress goes to stdout as JSON lines (``{"event": ..., ...}``) that the launcher reads; the final line carries a
checksum of the parameters so the launcher can check that every survivor holds the same model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["TrainConfig", "main", "train", "param_digest"]

from dataclasses import asdict, dataclass


@dataclass(kw_only=True)
class TrainConfig:
    """What one rank trains."""

    steps: int = 200
    """Committed steps to train."""
    precision: str = "nvfp4"
    """Weight precision: nvfp4, mxfp8, bf16, fp32."""
    batch_size: int = 8
    """Sequences per rank per step."""
    seq_len: int = 64
    """Characters per sequence."""
    lr: float = 3e-3
    """AdamW learning rate."""
    seed: int = 0
    """Seed of the model initialisation and of the data stream."""
    out: str = "./torchnext-demo"
    """Output folder (Flight Recorder dumps go to ``<out>/fr``)."""
    min_size: int = 2
    """Smallest group the job accepts."""
    member_id: int | None = None
    """Stable member id to ask the coordinator for (None: assigned)."""
    lowp_backend: str = "eager"
    """``torchnext.lowp.mm.scaled_mm`` backend."""
    standby: bool = False
    """Warm spare: build everything, then wait for a line on stdin before joining the group."""


def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def param_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in state_dict order (equal digests ⇔ bitwise-equal parameters)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # 0-d buffers too
    return h.hexdigest()


def _flatten_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Copy every gradient into ``flat`` (zeros for a parameter without one, e.g. an expert no sequence chose)."""
    off = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            flat[off:off + n].zero_()
        else:
            flat[off:off + n].copy_(p.grad.reshape(-1))
        off += n


def _unflatten_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    off = 0
    for p in params:
        n = p.numel()
        p.grad = flat[off:off + n].view_as(p).clone()
        off += n


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train until ``cfg.steps`` steps are committed; return this rank's final report."""
    from torchnext.comms import FlightRecorder, ReduceOp
    from torchnext.demo.data import VOCAB, batch_for_step
    from torchnext.demo.model import ModelConfig, MoETransformerLM, Precision
    from torchnext.ft import FaultTolerant, FaultTolerantConfig

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    model = MoETransformerLM(
        ModelConfig(vocab_size=len(VOCAB), precision=Precision(cfg.precision), lowp_backend=cfg.lowp_backend,
                    max_seq_len=max(128, cfg.seq_len))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    params = [p for p in model.parameters() if p.requires_grad]

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(s: dict[str, Any]) -> None:
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["optim"])

    fr_dir = Path(cfg.out) / "fr"
    fr_dir.mkdir(parents=True, exist_ok=True)
    if cfg.standby:
        _emit("standby", member=cfg.member_id, pid=os.getpid())
        if not sys.stdin.readline():
            _emit("standby_cancelled", member=cfg.member_id)
            return {"member": cfg.member_id, "steps": 0, "cancelled": True}
    ft = FaultTolerant(
        FaultTolerantConfig(min_size=cfg.min_size, member_id=cfg.member_id),
        state_dict=state_dict,
        load_state_dict=load_state_dict,
    )
    recorder = FlightRecorder.attach(ft.comm, capacity=2000, dump_dir=fr_dir, generation=ft.generation)

    def on_reconfigure(r: Any) -> None:
        recorder.add_communicator(ft.comm, generation=r.generation)
        _emit("reconfigured", member=ft.member_id, generation=r.generation, members=list(r.members), size=r.size,
              step=r.step, reason=r.reason, joiners=list(r.joiners), timings=r.timings,
              healed=None if r.healed is None else asdict(r.healed))

    ft.on_reconfigure(on_reconfigure)
    first = ft.reconfigurations[-1] if ft.reconfigurations else None
    healed = None if first is None or first.healed is None else asdict(first.healed)
    _emit("joined", member=ft.member_id, generation=ft.generation, size=ft.size, step=ft.step_count, pid=os.getpid(),
          healed=healed)

    flat = torch.zeros(sum(p.numel() for p in params))
    t_start = time.monotonic()
    tokens = 0
    while ft.step_count < cfg.steps:
        step_no = ft.step_count
        t0 = time.monotonic()
        with ft.step() as step:
            x, y = batch_for_step(step_no, seed=cfg.seed, shard=ft.rank, num_shards=ft.size,
                                  batch_size=cfg.batch_size, seq_len=cfg.seq_len)
            loss, lm = model.loss(x, y, step=step_no)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            _flatten_grads(params, flat)
            local_lm = torch.tensor([lm])
            ft.all_reduce(flat, ReduceOp.AVG)
            ft.all_reduce(local_lm, ReduceOp.AVG)
            if step.commit():
                _unflatten_grads(params, flat)
                opt.step()
                tokens += cfg.batch_size * cfg.seq_len * ft.size
                _emit("step", member=ft.member_id, step=ft.step_count, loss=float(local_lm), size=ft.size,
                      generation=ft.generation, step_s=time.monotonic() - t0,
                      tokens_per_s=tokens / max(time.monotonic() - t_start, 1e-9))
        if step.error is not None:
            _emit("step_failed", member=ft.member_id, step=step_no, error=f"{type(step.error).__name__}: {step.error}")
    recorder.dump(fr_dir, format="json", reason="end")
    recorder.dump(fr_dir, format="pickle", reason="end")
    recorder.detach()  # the end dumps stand: finishing closes (aborts) the communicator, which is not a failure
    report = {"member": ft.member_id, "rank": ft.rank, "generation": ft.generation, "steps": ft.step_count,
              "digest": param_digest(model), "wall_s": time.monotonic() - t_start}
    _emit("done", **report)
    # Every member committed the last step. finish() tells the coordinator the job is over, so members leave in any
    # order and no departure is taken for a failure (no final barrier needed).
    ft.finish()
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchnext.demo.train", description=__doc__.split("\n\n")[0])
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--precision", choices=["nvfp4", "mxfp8", "bf16", "fp32"], default=d.precision)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    p.add_argument("--min-size", type=int, default=d.min_size)
    p.add_argument("--member-id", type=int, default=None)
    p.add_argument("--lowp-backend", default=d.lowp_backend)
    p.add_argument("--standby", action="store_true", help="warm spare: join when a line arrives on stdin")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**{k: v for k, v in vars(args).items()})
    train(cfg)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
