"""The properties every data-parallel wrapper must have, as a test suite each `test_<wrapper>.py` binds to its
wrapper(s): every rank ends with the update of one process holding the global batch."""

import pytest
import torch

from tests.distributed import workloads
from tests.distributed.launch import WORLD, run


class AdapterSuite:
    """Subclasses set `wrapper` (a name `workloads.wrap` knows)."""

    wrapper: str
    #: the modes exact where ranks reach different layers (FSDP2's own reduce-scatter, which ghost's second pass
    #: runs, takes only the parameters with a gradient on each rank: it aborts there, as without flashdp)
    uneven_reach_modes = ("bk", "ghost")
    #: how a raw parameter meeting the batch by broadcast is counted (FSDP1's are views of its flat parameter, no
    #: leaves: the generic rule counts them)
    broadcast_counted_by = "broadcast"

    @pytest.mark.parametrize("mode", ["bk", "ghost"])
    def test_update_equals_one_process_on_the_union_batch(self, mode):
        ranks = run(workloads.rank_run, self.wrapper, mode, 0.0, None)
        expected_norms, expected_params = workloads.single_process(mode)
        torch.testing.assert_close(torch.cat([r["norms"] for r in ranks]), expected_norms, rtol=1e-5, atol=1e-6)
        for rank in ranks:
            for got, expected in zip(rank["params"], expected_params, strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("mode", ["bk", "ghost"])
    @pytest.mark.parametrize("mixed", [False, True], ids=["broadcast", "generic"])
    def test_raw_parameters_of_a_module_without_a_rule_equal_one_process(self, mixed, mode):
        """`tanh(x) * g + b` (counted where it meets the batch) or `tanh(x) @ g + b` (the generic rule's), in the
        root's unit. (Refused under FSDP2 until 2026-12-08: the recorder kept only copies of the parameters the
        generic rule runs with, which the coverage walk could not tell for the tensors the forward read.)"""
        strategies = check_raw_parameters(self.wrapper, mode, mixed)
        assert [v for k, v in strategies.items() if k.endswith("3.g")] == [
            "generic" if mixed else self.broadcast_counted_by
        ]

    def test_convolutions_with_direct_norms_equal_one_process(self):
        ranks = run(workloads.rank_cnn_run, self.wrapper, "bk")
        model = workloads.build_cnn()
        expected_norms, _ = workloads.cnn_step(model, model, workloads.cnn_images(), "bk")
        assert {s for r in ranks for name, s in r["strategies"].items() if name.endswith("weight")} == {"direct"}
        torch.testing.assert_close(torch.cat([r["norms"] for r in ranks]), expected_norms, rtol=1e-5, atol=1e-6)
        for rank in ranks:
            for got, expected in zip(rank["params"], model.parameters(), strict=True):
                torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("mode", ["bk", "ghost"])
    def test_a_rank_with_an_empty_batch_takes_part_in_the_step(self, mode):
        ranks = run(workloads.rank_with_empty_batch, self.wrapper, mode)
        model = workloads.build_model()
        expected_norms = workloads.train(
            model, model, workloads.global_batch()[:4], mode, noise=0.0, micro=workloads.BATCH
        )
        assert ranks[1]["norms"].shape == (0,)
        torch.testing.assert_close(ranks[0]["norms"], expected_norms, rtol=1e-5, atol=1e-6)
        for rank in ranks:
            for got, expected in zip(rank["params"], model.parameters(), strict=True):
                torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("mode", ["bk", "ghost"])
    def test_steps_whose_batches_change_are_exact_or_refused_on_every_rank(self, mode):
        """Rank 0 has a batch of one, then B == T, with a time-major layer: it must not trust what it could not
        learn from its batch of one. FSDP1 cannot verify a layout, so B == T is refused, on every rank at once."""
        ranks = run(workloads.rank_steps_with_changing_batches, self.wrapper, mode)
        if self.wrapper.startswith("fsdp1"):
            assert "Under FSDP1, which cannot run flashdp's verifying pass" in ranks[0]["error"]
            assert "Another rank refused" in ranks[1]["error"]
            return
        expected_norms, expected_params = workloads.single_process_steps(mode)
        assert_steps_of_one_process(ranks, expected_norms, expected_params)

    @pytest.mark.parametrize(
        ("mode", "micros"),
        [("bk", (2, 4)), ("bk", (2, 2, 4, 2)), ("ghost", (2, 2, 4, 2))],
        ids=["bk-two-then-one", "bk-two-two-one-two", "ghost-two-two-one-two"],
    )
    def test_steps_of_several_micro_batches_equal_one_process(self, mode, micros):
        """One engine, several steps, each accumulated over micro-batches of `micros[s]` rows (4: one backward):
        every step's norms and the final parameters are those of one process taking each global batch in one
        backward."""
        ranks = run(workloads.rank_steps_in_micro_batches, self.wrapper, mode, micros)
        assert not any("error" in rank for rank in ranks), [rank.get("error") for rank in ranks]
        expected_norms, expected_params = workloads.single_process_micro_steps(mode, len(micros))
        assert_steps_of_one_process(ranks, expected_norms, expected_params)

    def test_a_gradient_changed_on_one_rank_is_refused_on_every_rank(self):
        """(Refused before any pass of the backward: the same in every mode.)"""
        first, second = run(workloads.rank_with_a_foreign_grad_write, self.wrapper, "bk")
        assert "Another rank refused" in first["error"], first
        assert "changed between engine.backward and engine.backward" in second["error"], second

    def test_a_gradient_changed_on_one_rank_before_the_step_is_refused_on_every_rank(self):
        first, second = run(workloads.rank_with_a_foreign_grad_write, self.wrapper, "bk", True)
        assert "Another rank refused this step" in first["error"], first
        assert "changed between engine.backward and engine.step" in second["error"], second

    def test_a_layer_reached_on_one_rank_only_equals_one_process(self):
        """Rank 1's batch never calls a layer of a unit rank 0's calls (an expert no token was routed to): every
        rank reduce-scatters every unit, in the same order."""
        for mode in self.uneven_reach_modes:
            ranks = run(workloads.rank_with_a_branch_on_one_rank, self.wrapper, mode)
            expected_norms, expected_params = workloads.single_process_with_a_branch(mode)
            torch.testing.assert_close(torch.cat([r["norms"] for r in ranks]), expected_norms, rtol=1e-5, atol=1e-6)
            for rank in ranks:
                for got, expected in zip(rank["params"], expected_params, strict=True):
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m, x=mode: f"{x}: {m}")

    @pytest.mark.parametrize("mode", ["bk", "ghost"])
    def test_users_clipped_on_their_ranks_equal_one_process(self, mode):
        ranks = run(workloads.rank_with_users, self.wrapper, mode, False)
        model = workloads.build_model()
        ids = workloads.global_batch()
        norms = workloads.train(model, model, ids, mode, noise=0.0, micro=workloads.BATCH, users=workloads.USERS)
        torch.testing.assert_close(torch.cat([r["norms"] for r in ranks]), norms, rtol=1e-5, atol=1e-6)
        for rank in ranks:
            for got, expected in zip(rank["params"], model.parameters(), strict=True):
                torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)

    def test_a_user_on_two_ranks_is_refused_on_every_rank(self):
        for rank in run(workloads.rank_with_users, self.wrapper, "bk", True):
            assert "User(s) [2] have rows in several backward calls or ranks" in rank["error"]

    def test_a_nan_gradient_on_one_rank_stops_every_rank(self):
        said = run(workloads.rank_with_a_nan_gradient, self.wrapper, "bk")
        assert "sample 2 is not finite" in said[1]
        assert "A sample on another rank" in said[0]

    @pytest.mark.parametrize("mode", ["bk", "ghost"])
    def test_backward_runs_only_the_gradient_collectives_of_its_clipped_sums(self, mode):
        """One all-reduce of the decisions every rank must share (verify, self-check); this first backward
        verifies the layout (not under FSDP1, which cannot), and one more all-reduce agrees on what it found. The
        norm pass syncs nothing else. Then one all-reduce of one flag, so that every rank stops together when a
        sample's gradient is not finite. And, on an engine's first backward, one all-reduce agreeing on the privacy
        unit (users= or not). The clipped sums: under DDP reduced at step(); under FSDP2 one
        reduce-scatter per unit (bk: flashdp's, ghost: FSDP2's own in the second backward); under FSDP1 (one
        backward in every mode) one reduce-scatter per unit."""
        verifies = not self.wrapper.startswith("fsdp1")
        for rank in run(workloads.count_backward_collectives, self.wrapper, mode):
            sums = {"ddp": 0, "fsdp2": rank["fsdp2_units"]}.get(self.wrapper, rank["fsdp1_units"])
            unit = 1  # (the first backward only: every rank agrees it clips by sample, not by user)
            expected = unit + 2 + verifies + sums
            assert len(rank["gradient_collectives"]) == expected, rank["gradient_collectives"]


def check_noise_once_per_coordinate_with_the_right_std(wrapper: str) -> None:
    noisy = run(workloads.rank_run, wrapper, "bk", 1.0, 3)  # seeded: the std check below is then deterministic
    clean = run(workloads.rank_run, wrapper, "bk", 0.0, 3)
    per_rank = [torch.cat([n.flatten() for n in rank]) for rank in workloads.noise_only(noisy, clean)]
    expected_std = workloads.LR * 1.0 * 0.05 / workloads.BATCH
    if wrapper == "ddp":  # replicated: the same noise on every rank
        assert torch.equal(per_rank[0], per_rank[1])
        coords = per_rank[0]
    else:  # sharded: each rank noises its own shard, independently
        coords = torch.cat(per_rank)
        full_noisy = torch.cat([p.flatten() for p in noisy[0]["params"]])
        full_clean = torch.cat([p.flatten() for p in clean[0]["params"]])
        assert torch.equal(full_noisy, torch.cat([p.flatten() for p in noisy[1]["params"]]))
        padding = coords.numel() - full_noisy.numel()  # FSDP1 pads each flat parameter to a multiple of WORLD
        assert padding == 0 if wrapper == "fsdp2" else 0 <= padding < 2 * (WORLD - 1) + 1
        assert abs((full_noisy - full_clean).std().item() / expected_std - 1) < 0.15
    assert abs(coords.std().item() / expected_std - 1) < 0.15  # ~300 coordinates


def check_shards_draw_independent_noise(wrapper: str) -> None:
    noisy = run(workloads.rank_run, wrapper, "bk", 1.0, 5)
    clean = run(workloads.rank_run, wrapper, "bk", 0.0, 5)
    # the first local tensor noised (FSDP2: the embedding's shard, FSDP1: the root's flat shard), so equal
    # generators would give equal leading values
    first, second = (rank[0].flatten() for rank in workloads.noise_only(noisy, clean))
    n = min(len(first), len(second))
    # equal generators leave only rounding between the two (1e-6 of the noise); independent ones differ by O(1)
    assert (first[:n] - second[:n]).abs().max() > 0.1 * first.abs().max()


def assert_steps_of_one_process(ranks: list[dict], expected_norms: list, expected_params: list) -> None:
    """Every step's norms (the ranks' rows concatenated) and every rank's final parameters equal one process's."""
    for step, expected in enumerate(expected_norms):
        got = torch.cat([rank["norms"][step] for rank in ranks])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m, s=step: f"step {s}: {m}")
    for rank in ranks:
        for got, expected in zip(rank["params"], expected_params, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def check_raw_parameters(wrapper: str, mode: str, mixed: bool, own_unit: bool = False) -> dict[str, str]:
    """`workloads.rank_with_a_layer_scale` on every rank equals one process; rank 0's `engine.strategies`."""
    ranks = run(workloads.rank_with_a_layer_scale, wrapper, mode, mixed, own_unit)
    model = workloads.build_scaled_model(mixed)
    norms = workloads.train(model, model, workloads.global_batch(), mode, noise=0.0, micro=workloads.BATCH)
    torch.testing.assert_close(torch.cat([r["norms"] for r in ranks]), norms, rtol=1e-5, atol=1e-6)
    for rank in ranks:
        for got, expected in zip(rank["params"], model.parameters(), strict=True):
            torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-6)
    return ranks[0]["strategies"]
