from __future__ import annotations

import pytest

from torchnext._config import env_config


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("TORCHNEXT_FR_BUFFER_SIZE", "TORCHNEXT_AUTOTUNE"):
        monkeypatch.delenv(var, raising=False)
    cfg = env_config()
    assert cfg.fr_buffer_size == 2000
    assert cfg.autotune == "1"


def test_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHNEXT_FR_BUFFER_SIZE", "lots")
    with pytest.raises(ValueError, match="TORCHNEXT_FR_BUFFER_SIZE"):
        env_config()
    monkeypatch.setenv("TORCHNEXT_FR_BUFFER_SIZE", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        env_config()
    monkeypatch.setenv("TORCHNEXT_FR_BUFFER_SIZE", "0")
    monkeypatch.setenv("TORCHNEXT_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="TORCHNEXT_AUTOTUNE"):
        env_config()


def test_check_collectives_from_ours_or_torchs_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHNEXT_CHECK_COLLECTIVES", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    assert env_config().check_collectives is False
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert env_config().check_collectives is True
    monkeypatch.setenv("TORCHNEXT_CHECK_COLLECTIVES", "0")  # ours wins when set
    assert env_config().check_collectives is False
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    monkeypatch.setenv("TORCHNEXT_CHECK_COLLECTIVES", "1")
    assert env_config().check_collectives is True
    monkeypatch.setenv("TORCHNEXT_CHECK_COLLECTIVES", "yes")
    with pytest.raises(ValueError, match="TORCHNEXT_CHECK_COLLECTIVES"):
        env_config()
