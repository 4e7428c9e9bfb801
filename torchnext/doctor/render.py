"""Render a :class:`~torchnext.doctor.report.DoctorReport` as rich tables (imported only by the CLI).

Every string that comes from the environment or from a rule is escaped, so ``[gpu]`` in a reason prints as is.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from torchnext.doctor.facts import Facts
from torchnext.doctor.report import DoctorReport
from torchnext.doctor.rules import Severity

__all__ = ["render"]

# ---------------------------------------------------------------------------------------------------------------

_SEVERITY_STYLE = {Severity.INFO: "cyan", Severity.WARNING: "yellow", Severity.CRITICAL: "bold red"}


def _show(facts: Facts, name: str, value: object) -> str:
    reason = facts.unavailable.get(name)
    if reason is not None:
        return f"[dim]unavailable: {escape(reason)}[/dim]"
    if value is None:
        return "[dim]-[/dim]"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return escape(str(value))


def _environment_rows(facts: Facts) -> list[tuple[str, str]]:
    f = facts
    py = ".".join(str(x) for x in f.python_version)
    rows = [
        ("torchnext", escape(f.torchnext_version)),
        ("python", escape(f"{py} ({f.python_implementation}) {f.python_executable or ''}".strip())),
        ("os / machine", f"{_show(f, 'os', f.os)} / {_show(f, 'machine', f.machine)}"),
        ("torch", _show(f, "torch_version", f.torch_version)),
        (
            "torch git / debug",
            f"{_show(f, 'torch_git_version', f.torch_git_version)} / {_show(f, 'torch_debug', f.torch_debug)}",
        ),
        (
            "torch built for",
            f"CUDA {_show(f, 'torch_cuda_build', f.torch_cuda_build)}, "
            f"ROCm {_show(f, 'torch_hip_build', f.torch_hip_build)}",
        ),
        ("CUDA available", _show(f, "cuda_available", f.cuda_available)),
        ("NVIDIA driver", _show(f, "driver_version", f.driver_version)),
        ("NCCL", _show(f, "nccl_version", f.nccl_version)),
        ("torch.distributed", _show(f, "distributed_available", f.distributed_available)),
    ]
    if "c10d_backends" in f.unavailable:
        rows.append(("c10d backends", _show(f, "c10d_backends", None)))
    else:
        backends = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in f.c10d_backends.items()) or "none"
        rows.append(("c10d backends", backends))
    rows.append(("NVSHMEM (torch)", _show(f, "nvshmem_available", f.nvshmem_available)))
    compile_text = _show(f, "compile_supported", f.compile_supported)
    if f.compile_unsupported_reason:
        compile_text += f" ({escape(f.compile_unsupported_reason)})"
    rows.append(("torch.compile supported", compile_text))
    if f.torch_features:
        rows.append(("torch features", ", ".join(k for k, v in f.torch_features.items() if v) or "none"))
        missing = [k for k, v in f.torch_features.items() if not v]
        if missing:
            rows.append(("torch features missing", ", ".join(missing)))
    for short, version in f.packages.items():
        text = escape(version) if version is not None else "[dim]not installed[/dim]"
        if short in f.importable and not f.importable[short]:
            text += f" [red](import fails: {escape(f.unavailable.get('importable.' + short, '?'))})[/red]"
        rows.append((short, text))
    if "packages" in f.unavailable:
        rows.append(("packages", _show(f, "packages", None)))
    rows.append(("NVIDIA container", _show(f, "container_version", f.container_version)))
    for name, value in f.env.items():
        rows.append((f"${escape(name)}", escape(value)))
    if f.torchnext_config is None:
        rows.append(("TORCHNEXT_* settings", _show(f, "torchnext_config", None)))
    return rows


def render(report: DoctorReport, console: Console) -> None:
    """Print ``report`` as tables: environment, GPUs, torchnext backends, hazards (with advice for those that apply)."""
    facts = report.facts
    env = Table(title="Environment", show_header=False, title_justify="left")
    env.add_column("fact", style="bold")
    env.add_column("value")
    for key, value in _environment_rows(facts):
        env.add_row(key, value)
    console.print(env)

    if facts.gpus or "gpus" in facts.unavailable:
        gpus = Table(title="GPUs", title_justify="left")
        for col in ("index", "name", "capability", "memory GiB"):
            gpus.add_column(col)
        if "gpus" in facts.unavailable:
            gpus.add_row("-", _show(facts, "gpus", None), "", "")
        for g in facts.gpus:
            mem = "-" if g.total_memory_gib is None else f"{g.total_memory_gib:g}"
            gpus.add_row(str(g.index), escape(g.name), f"{g.capability[0]}.{g.capability[1]} ({g.sm})", mem)
        console.print(gpus)

    backends = Table(title="torchnext backends", title_justify="left")
    for col in ("area", "backend", "status", "why"):
        backends.add_column(col)
    for b in report.backends:
        status = "[green]available[/green]" if b.available else "[red]unavailable[/red]"
        backends.add_row(escape(b.area), escape(b.name), status, escape(b.reason))
    console.print(backends)

    hazards = Table(title="Known hazards", title_justify="left")
    for col in ("severity", "id", "status", "detail"):
        hazards.add_column(col)
    for h in report.hazards:
        style = _SEVERITY_STYLE[h.rule.severity]
        status = f"[{style}]APPLIES[/{style}]" if h.verdict.applies else "[green]ok[/green]"
        hazards.add_row(f"[{style}]{h.rule.severity.value}[/{style}]", h.rule.id, status, escape(h.verdict.detail))
    console.print(hazards)

    for h in report.applying:
        style = _SEVERITY_STYLE[h.rule.severity]
        body = (
            f"[bold]Here:[/bold] {escape(h.verdict.detail)}\n"
            f"[bold]What it means:[/bold] {escape(h.rule.meaning)}\n"
            f"[bold]What to do:[/bold] {escape(h.rule.what_to_do)}\n"
            f"[dim]Source: {escape(h.rule.source)}[/dim]"
        )
        title = f"[{style}]{h.rule.severity.value}[/{style}] {escape(h.rule.title)}"
        console.print(Panel(body, title=title, title_align="left"))

    n = len(report.applying)
    if n:
        console.print(f"[bold]{n} hazard(s) apply:[/bold] {', '.join(h.rule.id for h in report.applying)}")
    else:
        console.print(f"[bold green]No known hazard applies[/bold green] ({len(report.hazards)} checked).")
