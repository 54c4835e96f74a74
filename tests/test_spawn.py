"""tests/dist.py's spawn: every rank starts from a fork server that imported torch, transformers and ndp when the
session's first spawn ran, yet sees the caller's environment, import path and working directory as they are at the
call (a test's monkeypatched variable reaches its ranks, as it did when each rank was a fresh interpreter); a rank
that dies in native code reports where."""
import ctypes
import os
import sys

import pytest
import torch.multiprocessing as mp

from dist import spawn


def _sees(rank, world, env, path, cwd):
    assert os.environ.get("NDP_SPAWN_CHECK") == env, os.environ.get("NDP_SPAWN_CHECK")
    assert sys.path[0] == path and os.getcwd() == cwd, (sys.path[0], os.getcwd())


@pytest.mark.distributed
def test_ranks_see_the_callers_environment_path_and_directory_at_the_call(tmp_path, monkeypatch):
    for value in ("first", "second"):  # the second call's ranks come from the same fork server
        monkeypatch.setenv("NDP_SPAWN_CHECK", value)
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path / value))
        spawn(_sees, 2, tmp_path / value, value, str(tmp_path / value), str(tmp_path), timeout_s=30)


def _crashes_in_native_code(rank, world):
    if rank == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV


@pytest.mark.distributed
def test_a_rank_killed_by_a_signal_reports_its_python_stack(tmp_path):
    with pytest.raises(mp.ProcessExitedException, match="SIGSEGV") as err:
        spawn(_crashes_in_native_code, 2, tmp_path, timeout_s=30)
    assert "--- rank 1 ---" in str(err.value) and "_crashes_in_native_code" in str(err.value), str(err.value)
