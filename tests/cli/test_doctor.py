"""`torchnext doctor`: every hazard rule on faked environments, probes, the JSON schema, exit codes, a real run."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rich.console import Console

import torchnext
from torchnext.cli import main
from torchnext.doctor import (
    GPU,
    RULES,
    SCHEMA_VERSION,
    Availability,
    Facts,
    Probe,
    Rule,
    Severity,
    Verdict,
    build_report,
    builtin_probes,
    collect_facts,
    command,
    environment,
    evaluate_rules,
    probes,
    run_probes,
    version_tuple,
)
from torchnext.doctor.render import render

REPO_ROOT = Path(__file__).resolve().parents[2]

H100 = GPU(index=0, name="NVIDIA H100 80GB HBM3", capability=(9, 0), total_memory_gib=79.1)
H200 = GPU(index=0, name="NVIDIA H200", capability=(9, 0))
GH200 = GPU(index=0, name="NVIDIA GH200 480GB", capability=(9, 0))
THOR = GPU(index=0, name="NVIDIA Jetson AGX Thor", capability=(11, 0))
A100 = GPU(index=0, name="NVIDIA A100-SXM4-80GB", capability=(8, 0))
B200 = GPU(index=0, name="NVIDIA B200", capability=(10, 0))
RTX5090 = GPU(index=0, name="NVIDIA GeForce RTX 5090", capability=(12, 0))
MI300 = GPU(index=0, name="AMD Instinct MI300X", capability=(9, 4))


def cuda_facts(*gpus: GPU, **kw: object) -> Facts:
    """A CUDA machine with ``gpus`` (indices renumbered)."""
    numbered = tuple(dataclasses.replace(g, index=i) for i, g in enumerate(gpus))
    base: dict[str, object] = {
        "torch_cuda_build": "12.8",
        "cuda_available": True,
        "gpus": numbered,
        "driver_version": "570.86.15",
        "nccl_version": "2.27.5",
        "c10d_backends": {"gloo": True, "nccl": True, "mpi": False, "ucc": False},
    }
    base.update(kw)
    return Facts(**base)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# Each rule: environments where it applies, and where it does not
# ---------------------------------------------------------------------------------------------------------------

CASES: dict[str, tuple[list[Facts], list[Facts]]] = {
    "te-2.14-mxfp8-dbias": (
        [
            Facts(packages={"transformer_engine": "2.14.0"}),
            Facts(packages={"transformer_engine": "2.14"}),
            Facts(packages={"transformer_engine": "2.14.0+4e0d6f2"}),
        ],
        [
            Facts(),
            Facts(packages={"transformer_engine": None}),
            Facts(packages={"transformer_engine": "2.14.1"}),
            Facts(packages={"transformer_engine": "2.13.0"}),
            Facts(packages={"transformer_engine": "2.15.0"}),
            Facts(packages={"transformer_engine": "garbage"}),
        ],
    ),
    "flex-attention-ima": (
        [
            cuda_facts(H100, torch_version="2.14.0+cu128", machine="aarch64"),
            cuda_facts(H200),
            cuda_facts(GH200, torch_version="2.13.0"),
            cuda_facts(THOR),
            cuda_facts(A100, H100),
        ],
        [
            Facts(),
            cuda_facts(A100),
            cuda_facts(B200),
            cuda_facts(H100, torch_version="2.9.1"),
            cuda_facts(H100, torch_version=None, unavailable={"torch_version": "ImportError: x"}),
            Facts(unavailable={"gpus": "RuntimeError: CUDA driver too old"}),
            Facts(torch_hip_build="6.4", gpus=(MI300,)),
        ],
    ),
    "nvshmem-imex-channels": (
        [
            Facts(container_version="25.10"),
            Facts(container_version="26.08", env={"NVIDIA_IMEX_CHANNELS": ""}),
            cuda_facts(H100, container_version="25.11", packages={"nvshmem": "3.4.5"}),
        ],
        [
            Facts(),
            Facts(container_version="25.10", env={"NVIDIA_IMEX_CHANNELS": "0"}),
            Facts(container_version="25.09"),
            Facts(packages={"nvshmem": "3.4.5"}),  # pip wheel outside a container: mentioned, not flagged
            Facts(nvshmem_available=True),
        ],
    ),
    "compile-unsupported-python": (
        [
            Facts(python_version=(3, 15, 0)),
            Facts(compile_supported=False, compile_unsupported_reason="Python 3.15+ not yet supported"),
            Facts(python_version=(3, 13, 1), compile_supported=False),
        ],
        [
            Facts(),
            Facts(python_version=(3, 14, 2)),
            Facts(compile_supported=None, unavailable={"compile_supported": "ImportError: no _dynamo"}),
        ],
    ),
    "fp4-mx-needs-sm100": (
        [
            cuda_facts(H100),
            cuda_facts(A100),
            cuda_facts(B200, H100),
            Facts(torch_hip_build="6.4", cuda_available=True, gpus=(MI300,)),
        ],
        [
            Facts(),
            Facts(unavailable={"gpus": "RuntimeError: no"}),
            cuda_facts(B200),
            cuda_facts(RTX5090, THOR),
        ],
    ),
    "torch-too-old": (
        [Facts(torch_version="2.12.1"), Facts(torch_version="2.9.0a0+git1234"), Facts(torch_version="1.13.1")],
        [
            Facts(torch_version="2.13.0+cpu"),
            Facts(torch_version="2.14.1"),
            Facts(torch_version="3.0.0"),
            Facts(torch_version=None, unavailable={"torch_version": "AttributeError: __version__"}),
        ],
    ),
    "gloo-unavailable": (
        [
            Facts(distributed_available=False, c10d_backends={}),
            Facts(c10d_backends={"gloo": False, "nccl": True}),
        ],
        [
            Facts(),
            Facts(c10d_backends={}, unavailable={"c10d_backends": "RuntimeError: boom"}),
            Facts(distributed_available=None, unavailable={"distributed_available": "RuntimeError: boom"}),
        ],
    ),
    "nccl-async-error-handling-off": (
        [
            Facts(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}),
            cuda_facts(H100, env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": " 0"}),
        ],
        [
            Facts(),
            Facts(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}),
            Facts(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}),
        ],
    ),
    "gpu-driver-cpu-torch": (
        [Facts(driver_version="550.54.15", torch_version="2.14.0+cpu")],
        [Facts(), cuda_facts(H100), Facts(driver_version="6.3", torch_hip_build="6.4")],
    ),
    "cpu-alloc-small-pages": (
        [Facts(thp_mode="madvise"), Facts(thp_mode="madvise", env={"THP_MEM_ALLOC_ENABLE": "0"})],
        [
            Facts(),
            Facts(thp_mode="always"),
            Facts(thp_mode="never"),
            Facts(thp_mode="madvise", env={"THP_MEM_ALLOC_ENABLE": "1"}),
        ],
    ),
    "torchnext-config-invalid": (
        [
            Facts(
                torchnext_config=None,
                unavailable={"torchnext_config": "ValueError: TORCHNEXT_AUTOTUNE='x': expected one of"},
            )
        ],
        [Facts(), Facts(torchnext_config={"autotune": "readonly"})],
    ),
}

RULES_BY_ID = {r.id: r for r in RULES}


def test_rule_table_is_well_formed() -> None:
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids)), "duplicate rule id"
    for rule in RULES:
        assert rule.id == rule.id.strip().lower() and " " not in rule.id
        assert isinstance(rule.severity, Severity)
        for text in (rule.title, rule.meaning, rule.what_to_do, rule.source):
            assert text.strip(), f"{rule.id}: empty text field"
    # Every rule has cases on both sides (a rule added without a test fails here).
    assert set(CASES) == set(ids)
    # The five caveats the issue names are all in the table.
    assert {"te-2.14-mxfp8-dbias", "flex-attention-ima", "nvshmem-imex-channels", "compile-unsupported-python"} <= set(
        ids
    )
    assert "fp4-mx-needs-sm100" in ids


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_applies(rule_id: str) -> None:
    rule = RULES_BY_ID[rule_id]
    applies, _ = CASES[rule_id]
    assert applies
    for facts in applies:
        verdict = rule.detect(facts)
        assert verdict.applies, f"{rule_id} should apply: {verdict.detail}"
        assert verdict.detail and not verdict.detail.startswith("unknown")


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_does_not_apply(rule_id: str) -> None:
    rule = RULES_BY_ID[rule_id]
    _, clean = CASES[rule_id]
    assert clean
    for facts in clean:
        verdict = rule.detect(facts)
        assert not verdict.applies, f"{rule_id} should not apply to {facts}: {verdict.detail}"
        assert verdict.detail


def test_rule_details_name_what_decided() -> None:
    te = RULES_BY_ID["te-2.14-mxfp8-dbias"].detect(Facts(packages={"transformer_engine": "2.14.0+abc"}))
    assert "2.14.0+abc" in te.detail and "2.14.1" in te.detail
    flex = RULES_BY_ID["flex-attention-ima"].detect(cuda_facts(A100, H100, machine="aarch64"))
    assert (
        "cuda:1 NVIDIA H100 80GB HBM3 (sm_90)" in flex.detail and "A100" not in flex.detail and "aarch64" in flex.detail
    )
    fp4 = RULES_BY_ID["fp4-mx-needs-sm100"].detect(cuda_facts(B200, H100))
    assert "H100" in fp4.detail and "B200" not in fp4.detail
    unknown = RULES_BY_ID["gloo-unavailable"].detect(Facts(c10d_backends={}, unavailable={"c10d_backends": "X: y"}))
    assert unknown.detail.startswith("unknown") and "X: y" in unknown.detail
    outside = RULES_BY_ID["nvshmem-imex-channels"].detect(Facts(packages={"nvshmem": "3.4.5"}))
    assert "NVIDIA_IMEX_CHANNELS=0" in outside.detail and "3.4.5" in outside.detail
    py315 = RULES_BY_ID["compile-unsupported-python"].detect(Facts(python_version=(3, 15, 0)))
    assert "3.15.0" in py315.detail


def test_a_raising_rule_does_not_hide_the_others() -> None:
    def broken(facts: Facts) -> Verdict:
        raise KeyError("oops")

    bad = Rule(id="broken", title="t", severity=Severity.INFO, meaning="m", what_to_do="w", source="s", detect=broken)
    results = evaluate_rules(Facts(), (bad, *RULES))
    assert len(results) == len(RULES) + 1
    assert not results[0].verdict.applies and "KeyError" in results[0].verdict.detail


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.14.0a0+git1234", (2, 14, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("25.10", (25, 10)),
        ("v3.4.5", (3, 4, 5)),
        ("unknown", None),
        (None, None),
    ],
)
def test_version_tuple(text: str | None, expected: tuple[int, ...] | None) -> None:
    assert version_tuple(text) == expected


# ---------------------------------------------------------------------------------------------------------------
# Probes (torchnext backends)
# ---------------------------------------------------------------------------------------------------------------


def _status(facts: Facts) -> dict[str, tuple[bool, str]]:
    return {f"{s.area}/{s.name}": (s.available, s.reason) for s in run_probes(facts, builtin_probes.doctor_probes())}


def test_builtin_probes_on_a_cpu_machine() -> None:
    s = _status(Facts())
    assert s["comms/gloo"][0] and s["lowp/reference"][0] and s["control/compile"][0]
    assert not s["comms/nccl"][0]
    assert s["lowp/block-scaled-native"] == (False, "torch is not a CUDA build")
    assert not s["lowp/triton"][0] and "not installed" in s["lowp/triton"][1]


def test_builtin_probes_on_hopper_and_blackwell() -> None:
    features = {"scaled_mm": True, "functional_scaled_mm": True}
    hopper = _status(
        cuda_facts(H100, torch_features=features, packages={"triton": "3.5.0"}, importable={"triton": True})
    )
    assert not hopper["lowp/block-scaled-native"][0]
    assert "sm_100+" in hopper["lowp/block-scaled-native"][1] and "sm_90" in hopper["lowp/block-scaled-native"][1]
    assert hopper["lowp/triton"][0] and hopper["comms/nccl"][0] and "2.27.5" in hopper["comms/nccl"][1]
    blackwell = _status(
        cuda_facts(B200, torch_features=features, packages={"cutlass": "4.2.0"}, importable={"cutlass": True})
    )
    assert blackwell["lowp/block-scaled-native"][0] and blackwell["lowp/cutlass"][0]
    broken = _status(
        cuda_facts(
            B200,
            packages={"triton": "3.5.0"},
            importable={"triton": False},
            unavailable={"importable.triton": "ImportError: libcuda.so.1"},
        )
    )
    assert broken["lowp/triton"] == (False, "triton does not import: ImportError: libcuda.so.1")
    no_gpu = _status(Facts(torch_cuda_build="12.8", cuda_available=False))
    assert "no GPU is visible" in no_gpu["comms/nccl"][1] or "without the nccl" in no_gpu["comms/nccl"][1]


def test_probe_registry_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probes, "_REGISTERED", {})
    monkeypatch.setattr(probes, "PROBE_PROVIDERS", list(probes.PROBE_PROVIDERS))

    # A later contribution with the same (area, name) replaces the built-in probe.
    probes.register_probe(
        Probe(area="lowp", name="triton", check=lambda f: Availability(available=False, reason="from lowp registry"))
    )

    def explode(facts: Facts) -> Availability:
        raise RuntimeError("probe bug")

    probes.register_probe(Probe(area="lowp", name="exploding", check=explode))
    probes.register_probe_provider("torchnext.doctor._no_such_provider")
    with pytest.raises(ValueError, match="non-empty"):
        probes.register_probe(Probe(area="", name="x", check=lambda f: Availability(available=True, reason="")))

    statuses = {f"{s.area}/{s.name}": s for s in run_probes(Facts())}
    assert statuses["lowp/triton"].reason == "from lowp registry"
    assert sum(key == "lowp/triton" for key in statuses) == 1
    assert not statuses["lowp/exploding"].available
    assert "probe raised RuntimeError: probe bug" in statuses["lowp/exploding"].reason
    failure = statuses["doctor/torchnext.doctor._no_such_provider"]
    assert not failure.available and "ModuleNotFoundError" in failure.reason
    assert statuses["comms/gloo"].available  # built-ins still there


# ---------------------------------------------------------------------------------------------------------------
# Collecting facts on this machine
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_facts() -> Facts:
    return collect_facts()


def test_collect_facts_matches_torch(real_facts: Facts) -> None:
    f = real_facts
    assert f.torchnext_version == torchnext.__version__
    assert f.python_version == tuple(sys.version_info[:3])
    assert f.torch_version == torch.__version__
    assert f.torch_cuda_build == torch.version.cuda
    assert f.cuda_available == torch.cuda.is_available()
    assert f.distributed_available == dist.is_available()
    assert f.c10d_backends["gloo"] == dist.is_gloo_available()
    assert f.c10d_backends["nccl"] == dist.is_nccl_available()
    assert len(f.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert f.torch_features["scaled_mm"] == hasattr(torch, "_scaled_mm")
    import torch._higher_order_ops as hops

    assert f.torch_features["switch_hop"] == hasattr(hops, "switch")
    assert f.packages["torchao"] is not None  # a test dependency
    assert f.unavailable == {}, f.unavailable
    json.dumps(f.to_json())


def test_a_failing_probe_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> dict[str, bool]:
        raise RuntimeError("c10d exploded")

    monkeypatch.setattr(environment, "_c10d_backends", boom)
    monkeypatch.setitem(environment.TORCH_FEATURES, "switch_hop", lambda: 1 / 0)
    monkeypatch.setenv("TORCHNEXT_FR_BUFFER_SIZE", "lots")
    facts = collect_facts()
    assert facts.unavailable["c10d_backends"] == "RuntimeError: c10d exploded"
    assert facts.c10d_backends == {}
    assert facts.unavailable["torch_features.switch_hop"].startswith("ZeroDivisionError")
    assert "switch_hop" not in facts.torch_features
    assert facts.torchnext_config is None and "TORCHNEXT_FR_BUFFER_SIZE" in facts.unavailable["torchnext_config"]
    assert facts.env["TORCHNEXT_FR_BUFFER_SIZE"] == "lots"
    report = build_report(facts)
    applying = {h.rule.id for h in report.applying}
    assert "torchnext-config-invalid" in applying and "gloo-unavailable" not in applying
    out = io.StringIO()
    render(report, Console(file=out, width=200, color_system=None))
    assert "unavailable: RuntimeError: c10d exploded" in out.getvalue()


def test_driver_version_from_proc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    proc = tmp_path / "version"
    proc.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder@U16)\n"
        "GCC version:  gcc version 12.3.0\n"
    )
    monkeypatch.setattr(environment, "_PROC_DRIVER", proc)
    assert environment._driver_version(cuda_available=False) == "570.86.15"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:15:33 UTC 2024\n")
    assert environment._driver_version(cuda_available=False) == "550.54.15"
    monkeypatch.setattr(environment, "_PROC_DRIVER", tmp_path / "absent")
    monkeypatch.setattr(environment.shutil, "which", lambda name: None)
    assert environment._driver_version(cuda_available=True) is None


def test_relevant_environment_filters_and_hides_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchnext._config import relevant_environment

    monkeypatch.setenv("NVIDIA_IMEX_CHANNELS", "0")
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    monkeypatch.setenv("TORCHNEXT_API_KEY", "hunter2")
    monkeypatch.setenv("UNRELATED_VAR", "x")
    env = relevant_environment()
    assert env["NVIDIA_IMEX_CHANNELS"] == "0" and env["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert "TORCHNEXT_API_KEY" not in env and "UNRELATED_VAR" not in env


# ---------------------------------------------------------------------------------------------------------------
# Report: JSON schema, rendering, exit codes
# ---------------------------------------------------------------------------------------------------------------

HAZARD_KEYS = {"id", "title", "severity", "applies", "detail", "meaning", "what_to_do", "source"}


def check_schema(doc: dict[str, object]) -> None:
    assert doc["schema_version"] == SCHEMA_VERSION
    assert set(doc) == {"schema_version", "facts", "hazards", "torchnext", "summary"}
    facts = doc["facts"]
    assert isinstance(facts, dict)
    assert {f.name for f in dataclasses.fields(Facts)} == set(facts)
    hazards = doc["hazards"]
    assert isinstance(hazards, list) and len(hazards) == len(RULES)
    for h in hazards:
        assert set(h) == HAZARD_KEYS
        assert isinstance(h["applies"], bool) and h["severity"] in {s.value for s in Severity}
    tn = doc["torchnext"]
    assert isinstance(tn, dict) and set(tn) == {"version", "backends"}
    for b in tn["backends"]:
        assert set(b) == {"area", "name", "available", "reason"} and isinstance(b["available"], bool)
    summary = doc["summary"]
    assert isinstance(summary, dict)
    assert summary["hazards_applying"] == [h["id"] for h in hazards if h["applies"]]


def test_json_schema_of_a_faked_report() -> None:
    facts = cuda_facts(H100, packages={"transformer_engine": "2.14.0"}, container_version="25.10")
    doc = json.loads(json.dumps(build_report(facts).to_json()))
    check_schema(doc)
    assert doc["facts"]["gpus"][0] == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "capability": [9, 0],
        "total_memory_gib": 79.1,
    }
    applying = set(doc["summary"]["hazards_applying"])
    assert applying == {"te-2.14-mxfp8-dbias", "flex-attention-ima", "nvshmem-imex-channels", "fp4-mx-needs-sm100"}


def test_render_shows_advice_and_escapes_markup() -> None:
    facts = cuda_facts(H100, packages={"transformer_engine": "2.14.0", "triton": None})
    out = io.StringIO()
    render(build_report(facts), Console(file=out, width=250, color_system=None))
    text = out.getvalue()
    for needle in ("Environment", "GPUs", "torchnext backends", "Known hazards", "What to do:", "sm_90"):
        assert needle in text
    assert "pip install 'torchnext[gpu]'" in text  # rich markup in a reason is escaped, not swallowed
    assert "hazard(s) apply: te-2.14-mxfp8-dbias" in text
    clean = io.StringIO()
    render(build_report(Facts()), Console(file=clean, width=250, color_system=None))
    assert "No known hazard applies" in clean.getvalue()


@pytest.mark.parametrize(
    ("facts", "strict", "code"),
    [
        (Facts(), False, 0),
        (Facts(), True, 0),
        (Facts(torch_version="2.12.0"), False, 0),
        (Facts(torch_version="2.12.0"), True, 1),
        (cuda_facts(H100), True, 1),
        (Facts(thp_mode="madvise"), False, 0),
        (Facts(thp_mode="madvise"), True, 0),  # an info hazard applies: advice, not a failed gate
    ],
)
def test_strict_exit_codes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], facts: Facts, strict: bool, code: int
) -> None:
    monkeypatch.setattr(command, "build_report", lambda: build_report(facts))
    argv = ["doctor", "--json", *(["--strict"] if strict else [])]
    assert main(argv) == code
    check_schema(json.loads(capsys.readouterr().out))


def _run_doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "torchnext", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=full_env,
        cwd=REPO_ROOT,
    )


def test_real_doctor_json_run() -> None:
    proc = _run_doctor("--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    check_schema(doc)
    assert doc["facts"]["torch_version"] == torch.__version__
    assert doc["torchnext"]["version"] == torchnext.__version__
    backends = {(b["area"], b["name"]): b for b in doc["torchnext"]["backends"]}
    assert backends[("comms", "gloo")]["available"] == dist.is_gloo_available()
    assert backends[("lowp", "reference")]["available"]


def test_real_doctor_strict_fails_on_a_real_hazard() -> None:
    proc = _run_doctor("--strict", TORCHNEXT_AUTOTUNE="sometimes", TORCH_NCCL_ASYNC_ERROR_HANDLING="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "torchnext-config-invalid" in proc.stdout and "nccl-async-error-handling-off" in proc.stdout
    assert "What to do:" in proc.stdout


def test_import_doctor_is_lean() -> None:
    code = textwrap.dedent(
        """
        import sys
        import torch
        import torchnext.doctor
        assert not torch.cuda.is_initialized(), "CUDA initialised"
        for mod in ("rich", "torch._dynamo", "triton", "cutlass", "transformer_engine"):
            assert mod not in sys.modules, mod + " imported by `import torchnext.doctor`"
        print("LEAN")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docs_list_every_rule_and_the_api_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (REPO_ROOT / "docs" / "doctor.md").read_text()
    assert "## torchnext doctor" in text
    for rule in RULES:
        assert f"`{rule.id}`" in text, f"docs/doctor.md does not describe {rule.id}"
    example = text.split("### Python API", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    exec(compile(example, "docs/doctor.md", "exec"), {})
    out = capsys.readouterr().out
    assert "fp4-mx-needs-sm100" in out and "flex-attention-ima" in out and "hazards_applying" in out


def test_thp_mode_parsing(tmp_path: Path) -> None:
    from torchnext.doctor.environment import _thp_mode

    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert _thp_mode(str(f)) == "madvise"
    f.write_text("[always] madvise never\n")
    assert _thp_mode(str(f)) == "always"
    assert _thp_mode(str(tmp_path / "missing")) is None
