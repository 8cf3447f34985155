"""runner/blas.py: no cuBLAS workspace unless the user chose otherwise."""
import os

from slipstream.runner.blas import prefer_unsplit_gemms

KEYS = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "SLIPSTREAM_CUBLAS_WORKSPACE")


def _clear(monkeypatch):
    for k in KEYS:
        monkeypatch.delenv(k, raising=False)


def test_sets_no_workspace_where_nothing_is_set(monkeypatch):
    _clear(monkeypatch)
    assert prefer_unsplit_gemms() == {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0"


def test_a_users_setting_stands(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert prefer_unsplit_gemms() == {}
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "CUBLASLT_WORKSPACE_SIZE" not in os.environ


def test_torch_leaves_the_defaults(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setenv("SLIPSTREAM_CUBLAS_WORKSPACE", "torch")
    assert prefer_unsplit_gemms() == {} and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
