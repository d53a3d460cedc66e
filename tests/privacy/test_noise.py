"""NoiseSource.add_to: one draw per bucket of tensors of one device and dtype, each coordinate its own N(0, std^2)."""

import os
import time

import pytest
import torch

from flashdp.privacy import NoiseSource, keyed
from flashdp.privacy import noise as noise_module
from tests.twister import is_a_seeds_expansion


def test_buckets_cut_by_dtype_and_size(monkeypatch):
    monkeypatch.setattr(noise_module, "BUCKET_ELEMENTS", 10)
    a, b, c = torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4)
    d, big = torch.zeros(4), torch.zeros(30)
    buckets = noise_module.buckets([a, b, c, d, big])
    assert [[id(t) for t in bucket] for bucket in buckets] == [[id(a), id(c)], [id(b)], [id(d)], [id(big)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_coordinate_gets_its_own_noise_of_the_right_std(dtype, monkeypatch):
    monkeypatch.setattr(noise_module, "BUCKET_ELEMENTS", 30_000)  # several buckets, several tensors in each
    tensors = [torch.full((100, 50), 1.0, dtype=dtype) for _ in range(8)] + [torch.zeros(0, dtype=dtype)]
    NoiseSource(seed=0, kind="seeded").add_to(tensors, std=2.0)
    drawn = [t.double() - 1.0 for t in tensors[:-1]]
    everything = torch.cat([t.flatten() for t in drawn])
    assert abs(everything.std().item() / 2.0 - 1) < 0.03
    assert abs(everything.mean().item()) < 0.03 * 2.0
    for first in range(len(drawn)):  # no two tensors share a draw (a wrong split would repeat one)
        for second in range(first + 1, len(drawn)):
            assert not torch.equal(drawn[first], drawn[second])
    assert all(t.dtype == dtype for t in tensors)


def test_the_shared_draw_is_what_is_added():
    tensors = [torch.zeros(3, 2), torch.zeros(5)]
    NoiseSource(seed=0, kind="seeded").add_to(tensors, std=1.0, share=lambda n: torch.arange(len(n)).float())
    assert torch.equal(tensors[0], torch.arange(6).float().view(3, 2))
    assert torch.equal(tensors[1], torch.arange(6, 11).float())


def _draw_in_lanes(source, threads, monkeypatch):
    monkeypatch.setattr(noise_module, "LANE_ELEMENTS", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    return source.gaussian(torch.Size([1000, 3]), 2.0, torch.device("cpu"), torch.float32)


def test_a_large_cpu_draw_in_lanes_is_the_same_on_any_number_of_threads(monkeypatch):
    """Drawn in `CPU_LANES` parts, each from its own generator: the same values whether the parts run on one thread
    or several, every coordinate its own draw of the right std."""
    alone = _draw_in_lanes(NoiseSource(seed=3, kind="seeded"), 1, monkeypatch)
    threaded = _draw_in_lanes(NoiseSource(seed=3, kind="seeded"), 4, monkeypatch)
    assert torch.equal(alone, threaded)
    assert abs(alone.std().item() / 2.0 - 1) < 0.05
    lanes = alone.view(-1).tensor_split(noise_module.CPU_LANES)
    firsts = [lane[:50] for lane in lanes]  # (lanes seeded alike would start alike)
    assert all(not torch.equal(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])


def test_a_seeded_source_drawing_in_lanes_resumes_its_stream(monkeypatch):
    source = NoiseSource(seed=5, kind="seeded")
    _draw_in_lanes(source, 2, monkeypatch)
    resumed = NoiseSource(seed=5, kind="seeded")
    resumed.load_state_dict(source.state_dict())
    assert len(source.state_dict()["generators"]) == noise_module.CPU_LANES
    assert torch.equal(_draw_in_lanes(source, 2, monkeypatch), _draw_in_lanes(resumed, 2, monkeypatch))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_draws_in_lanes_with_threads_of_its_own(monkeypatch):
    """(A pool made before a fork has no threads in the child: a draw there would wait forever.)"""
    _draw_in_lanes(NoiseSource(seed=1, kind="seeded"), 4, monkeypatch)  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: exits 0 once its draw is done
        _draw_in_lanes(NoiseSource(seed=1, kind="seeded"), 4, monkeypatch)
        os._exit(0)
    for _ in range(200):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child's draw did not finish in 10 s")


def test_no_noise_generator_draws_the_stream_of_a_seed_near_the_users():
    """(Seeded `seed + k`, generator k drew the very stream of the Poisson sampler of rank k, seeded `seed + k`:
    on rank 0 the batch was chosen by the numbers the noise was made of.) Torch's CPU generator keeps a seed's low
    32 bits, so streams are compared, not seeds."""
    seed = 1234
    source = NoiseSource(seed=seed, kind="seeded")
    firsts = [source._generator(torch.device("cpu"), k).initial_seed() for k in range(noise_module.CPU_LANES)]
    near = {torch.Generator().manual_seed(seed + r).initial_seed() & 0xFFFFFFFF for r in range(-64, 64)}
    assert not near & {s & 0xFFFFFFFF for s in firsts}
    assert len({s & 0xFFFFFFFF for s in firsts}) == len(firsts)


def test_the_layout_read_here_is_torchs():
    """(So that the tests below can fail: a seeded generator's state is a seed's expansion.)"""
    assert is_a_seeds_expansion(torch.Generator().manual_seed(2**40 + 7))


def test_a_secret_sources_cpu_generators_hold_more_than_32_bits():
    """(A secret source was seeded from 63 bits of OS entropy; torch's CPU generator kept 32 of them, so its noise
    was one of 2^32 streams: an adversary knowing every record but one could enumerate them and remove the noise.)
    Every lane's generator has a state that is no seed's expansion, and two sources' states differ."""
    first, second = NoiseSource(keyed.secret_key(), "secret"), NoiseSource(keyed.secret_key(), "secret")
    for k in range(noise_module.CPU_LANES):
        made = first._generator(torch.device("cpu"), k)
        assert not is_a_seeds_expansion(made)
        assert not torch.equal(made.get_state(), second._generator(torch.device("cpu"), k).get_state())
    drawn = first.gaussian(torch.Size([noise_module.LANE_ELEMENTS * 2]), 1.0, torch.device("cpu"), torch.float32)
    assert abs(drawn.std().item() - 1) < 0.01 and abs(drawn.mean().item()) < 0.01


def test_a_keyed_generator_is_a_function_of_its_key_and_index_only():
    key = keyed.secret_key()
    arguments = [(key, 0), (key, 0), (key, 1), (key + 1, 0), (key + 2**32, 0)]
    draws = [
        torch.randn(8, generator=keyed.keyed_generator(k, i, torch.device("cpu")), device="cpu") for k, i in arguments
    ]
    assert torch.equal(draws[0], draws[1])
    assert all(not torch.equal(draws[0], other) for other in draws[2:])
