"""Each rank's own random generators: saved per rank, restored onto the device the rank trains
on now. CUDA's generators are stood in for by a fake, so this runs on any host."""

from __future__ import annotations

import pytest
import torch

from amp_exp.training.rng import own_rng_state, restore_rng_state, rng_state


class FakeCudaGenerators:
    """``count`` devices, each with its own generator state; torch.cuda's per-device calls."""

    def __init__(self, count: int) -> None:
        self.states = {index: torch.full((16,), index, dtype=torch.uint8) for index in range(count)}

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return self.states[torch.device(device).index].clone()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        # A device the host lacks fails as torch's does: an index error.
        index = torch.device(device).index
        if index not in self.states:
            raise IndexError(f"list index out of range: cuda:{index}")
        self.states[index] = state.clone()


@pytest.fixture
def cuda(monkeypatch):
    def install(count: int) -> FakeCudaGenerators:
        fake = FakeCudaGenerators(count)
        monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
        return fake

    return install


def cuda_device(index: int) -> torch.device:
    return torch.device("cuda", index)


def test_each_rank_saves_its_own_device_generator_and_restores_it(cuda) -> None:
    """Rank 1 trains on cuda:1: it keeps cuda:1's state, and gets it back on cuda:1, untouched
    by rank 0's (which never drew from cuda:1)."""
    fake = cuda(2)
    states = [rng_state(cuda_device(rank)) for rank in (0, 1)]
    assert [state["device"][0].item() for state in states] == [0, 1]
    fake.states[1].fill_(99)  # rank 1 draws on
    restore_rng_state(own_rng_state(states, 1), cuda_device(1))
    assert fake.states[1].tolist() == [1] * 16 and fake.states[0].tolist() == [0] * 16


def test_a_resume_on_a_host_with_fewer_gpus_restores_onto_the_gpu_it_has(cuda) -> None:
    """A one-GPU run that trained on cuda:3 of four resumes on a host with one GPU."""
    cuda(4)
    saved = [rng_state(cuda_device(3))]
    fake = cuda(1)
    restore_rng_state(own_rng_state(saved, 0), cuda_device(0))
    assert fake.states[0].tolist() == [3] * 16


def test_a_gpu_checkpoint_resumes_on_the_cpu_and_a_rank_beyond_the_checkpoint_takes_rank_0s(
    cuda,
) -> None:
    cuda(2)
    states = [rng_state(cuda_device(rank)) for rank in (0, 1)]
    torch.manual_seed(3)
    expected = torch.get_rng_state()
    states[0]["torch"] = expected
    torch.manual_seed(4)
    # An FSDP2 checkpoint of two ranks resumed by rank 2 of three, on the CPU.
    restore_rng_state(own_rng_state(states, 2), torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), expected)
