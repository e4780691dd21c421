"""The engine on CPU takes one worker's share of the cores under `server.workers` unless its
`num_threads` says otherwise (`backends/cores.py`)."""

from __future__ import annotations

import pytest
import torch

from backends.cores import WORKERS_ENV, available_cores, cores_per_worker
from tests.backends.torch_llm.conftest import engine_for

#: a thread count that no worker's share equals, so a change is seen
SENTINEL = available_cores() + 1


@pytest.fixture
def threads_restored():  # noqa: ANN201
    before = torch.get_num_threads()
    torch.set_num_threads(SENTINEL)
    yield
    torch.set_num_threads(before)


def test_the_engine_takes_one_workers_share_of_the_cores(llama_dir, monkeypatch, threads_restored) -> None:  # noqa: ANN001
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    engine_for(llama_dir)
    assert torch.get_num_threads() == SENTINEL  # alone: torch's setting is left as it is
    monkeypatch.setenv(WORKERS_ENV, "2")
    engine_for(llama_dir)
    assert torch.get_num_threads() == cores_per_worker()
    engine_for(llama_dir, num_threads=SENTINEL + 1)
    assert torch.get_num_threads() == SENTINEL + 1  # the option wins
