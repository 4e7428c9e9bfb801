"""The CPU shims torchnext's torchtitan tests run under (``torchnext.testing.torchtitan_cpu``): the device module,
``dist.set_timeout`` for torch 2.13, dense attention in place of FlexAttention (no CPU backward), FSDP2's force-sum
on Gloo only; each applied inside ``torchtitan_on_cpu()`` and undone on exit. Plus the tiny assets and the
TensorBoard reader."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchnext.testing import RankContext, run_ranks
from torchnext.testing.torchtitan_cpu import CPU_DEVICE, dense_flex_attention, read_scalars, write_tiny_assets

pytestmark = [pytest.mark.titan, pytest.mark.timeout(300)]


def test_cpu_device_module_answers_torchtitans_calls() -> None:
    CPU_DEVICE.set_device(torch.device("cpu", 0))
    CPU_DEVICE.set_device("cpu")
    CPU_DEVICE.set_device(0)
    with pytest.raises(ValueError, match="cuda:0"):
        CPU_DEVICE.set_device("cuda:0")
    with pytest.raises(ValueError, match="cpu:1"):
        CPU_DEVICE.set_device("cpu:1")
    assert CPU_DEVICE.device_count() == 1 and CPU_DEVICE.current_device() == 0 and CPU_DEVICE.is_available()
    assert CPU_DEVICE.get_device_properties(torch.device("cpu", 0)).total_memory > 2**30
    stats = CPU_DEVICE.memory_stats("cpu:0")
    assert stats["active_bytes.all.peak"] == stats["reserved_bytes.all.peak"] > 2**20  # this process's peak RSS
    assert stats["num_alloc_retries"] == stats["num_ooms"] == 0
    with pytest.raises(NotImplementedError, match="memory profiler"):
        CPU_DEVICE.memory._record_memory_history(max_entries=10)


def _document_mask(docs: torch.Tensor) -> Any:
    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (q >= kv) & (docs[b, q] == docs[b, kv])

    return mask_mod


@pytest.mark.parametrize("gqa", [False, True])
def test_dense_attention_matches_flex_forward_and_sdpa_backward(gqa: bool) -> None:
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    torch.manual_seed(0)
    b, h, n, e = 2, 4, 64, 16
    hkv = 2 if gqa else h
    q = torch.randn(b, h, n, e, requires_grad=True)
    k, v = (torch.randn(b, hkv, n, e, requires_grad=True) for _ in range(2))
    docs = torch.randint(0, 3, (b, n)).sort(-1).values
    docs[0, 40:] = 5  # a document starting mid-block
    mask_mod = _document_mask(docs)
    block_mask = create_block_mask(mask_mod, b, None, n, n, device="cpu", BLOCK_SIZE=16)
    out, aux = dense_flex_attention(q, k, v, score_mod=None, block_mask=block_mask, scale=0.3, enable_gqa=gqa,
                                    return_aux=AuxRequest(lse=True))
    with pytest.raises(NotImplementedError, match="backward on CPU"):  # why the shim exists (torch 2.13)
        flex_attention(q, k, v, block_mask=block_mask, scale=0.3, enable_gqa=gqa)
    ref, ref_aux = flex_attention(q.detach(), k.detach(), v.detach(), block_mask=block_mask, scale=0.3,
                                  enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux.lse, ref_aux.lse, rtol=1e-5, atol=1e-5)
    # gradients: against SDPA over the same boolean mask
    allowed = (torch.arange(n)[:, None] >= torch.arange(n)[None, :]) & (docs[:, None, :, None] == docs[:, None, None, :])
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    rep = h // hkv
    ref_out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=allowed, scale=0.3)
    ref_grads = torch.autograd.grad(ref_out.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    with pytest.raises(NotImplementedError, match="score_mod"):
        dense_flex_attention(q, k, v, score_mod=lambda s, *_: s, block_mask=block_mask, scale=None,
                             enable_gqa=gqa, return_aux=AuxRequest())


def shims_body(ctx: RankContext) -> dict[str, Any]:
    import torchtitan.tools.utils as tt_utils
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.models.common import attention

    import torchnext  # noqa: F401
    from torchnext.testing.torchtitan_cpu import torchtitan_on_cpu

    os.environ["LOCAL_RANK"] = "0"
    out: dict[str, Any] = {"before": (tt_utils.device_type, hasattr(dist, "set_timeout"))}
    compiled = attention.FlexAttention.compiled_flex_attn
    with torchtitan_on_cpu() as shims:
        import torchtitan.components.metrics as metrics  # imported under the shims: binds the CPU module

        out["applied"] = list(shims.applied)
        out["device"] = (tt_utils.device_type, tt_utils.device_module is CPU_DEVICE, metrics.device_module is CPU_DEVICE,
                         str(tt_utils.get_local_device()))
        out["attention"] = attention.FlexAttention.compiled_flex_attn is dense_flex_attention
        for backend in ("gloo", "torchnext"):
            dist.init_process_group(backend, store=dist.PrefixStore(backend, ctx.store), rank=ctx.rank,
                                    world_size=ctx.world_size)
            module = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (ctx.world_size,)))
            module.set_gradient_divide_factor(1.0)
            group = module._get_fsdp_state()._fsdp_param_group
            out[f"force_sum_{backend}"] = group.force_sum_reduction_for_comms
            dist.set_timeout(timedelta(seconds=7))  # type: ignore[attr-defined]  # the shim on 2.13
            if backend == "torchnext":
                out["torchnext_timeout"] = [c.timeout.total_seconds() for c in dist.group.WORLD.communicators.values()]
            dist.destroy_process_group()
    out["after"] = (tt_utils.device_type, hasattr(dist, "set_timeout"),
                    attention.FlexAttention.compiled_flex_attn is compiled, shims.applied)
    return out


def test_shims_apply_where_needed_and_are_undone() -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchnext[titan])")
    (res,) = run_ranks(shims_body, 1, timeout=240)
    has_set_timeout = hasattr(dist, "set_timeout")  # torch >= 2.14
    assert res["before"] == ("cuda", has_set_timeout)  # torchtitan's pick on a machine without an accelerator
    assert res["applied"] == ["device", *([] if has_set_timeout else ["set_timeout"]), "attention", "gloo_force_sum"]
    assert res["device"] == ("cpu", True, True, "cpu:0")
    assert res["attention"] is True
    assert res["force_sum_gloo"] is True and res["force_sum_torchnext"] is False  # torchnext takes PREMUL_SUM
    assert res["torchnext_timeout"] == [7.0]
    assert res["after"] == ("cuda", has_set_timeout, True, [])


def test_unknown_patch_is_refused() -> None:
    from torchnext.testing.torchtitan_cpu import torchtitan_on_cpu

    with pytest.raises(ValueError, match="unknown patches \\['devise'\\]"), torchtitan_on_cpu(skip=["devise"]):
        pass


def test_tiny_assets_load_in_torchtitans_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchnext[titan])")
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok_dir, data_dir = write_tiny_assets(tmp_path, documents=3)
    tok = HuggingFaceTokenizer(tokenizer_path=tok_dir)
    assert tok.get_vocab_size() == 1003 and tok.bos_id == 1 and tok.eos_id == 2
    lines = (Path(data_dir) / "train.json").read_text().splitlines()
    assert len(lines) == 3
    text = json.loads(lines[0])["text"]
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert len(ids) == len(text.split()) + 2 and ids[0] == 1 and ids[-1] == 2
    assert 0 not in ids  # every word known: no <unk>


def test_read_scalars_reads_what_a_summary_writer_wrote(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    values = [8.038761138916016, 0.8032371401786804]  # float32 values: read back exactly
    for rank in (0, 1):
        w = SummaryWriter(str(tmp_path / "tb" / "run" / f"rank_{rank}"))
        for step in (1, 2):
            w.add_scalar("loss_metrics/global_avg_loss", values[0] + step + rank, step)
            w.add_scalar("grad_norm", values[1], step)
        w.close()
    got = read_scalars(tmp_path / "tb")
    assert got[1]["loss_metrics/global_avg_loss"] == {1: float(torch.tensor(values[0] + 2).float()),
                                                      2: float(torch.tensor(values[0] + 3).float())}
    assert got[0]["grad_norm"] == {1: values[1], 2: values[1]}
    (tmp_path / "tb" / "run2").mkdir()
    with pytest.raises(ValueError, match="2 runs"):
        read_scalars(tmp_path / "tb")
    with pytest.raises(FileNotFoundError):
        read_scalars(tmp_path / "none")


def test_runner_refuses_bad_arguments(tmp_path: Path) -> None:
    from torchnext.testing.torchtitan_cpu import main

    with pytest.raises(SystemExit, match="--runs needs a JSON file"):
        main(["--runs"])
    bad = tmp_path / "runs.json"
    bad.write_text('[["--a"], "b"]')
    with pytest.raises(SystemExit, match="expected a JSON list of lists of strings"):
        main(["--runs", str(bad), "-m", "torchtitan.train"])
    with pytest.raises(SystemExit, match="usage"):
        main(["-m"])
