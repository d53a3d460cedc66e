"""DP training of a Llama-style model under FSDP: step time and peak memory by mode and sequence length.

    torchrun --nproc_per_node=2 examples/fsdp_llama.py                  # CPU, gloo: about 2 minutes
    torchrun --nproc_per_node=2 examples/fsdp_llama.py --modes no_dp,bk --seq-lens 128,512 --wrapper fsdp1
    python examples/plot_fsdp_llama.py out/fsdp_llama                   # figures and the summary table

Each (mode, sequence length) is one run: a fresh model built from a transformers LlamaConfig, sharded with FSDP2
(`fully_shard` on every decoder layer, then the root) or FSDP1, AdamW, random token ids (the figures do not depend
on the data), `--warmup` untimed steps, then `--steps` timed ones. Modes: no_dp (plain training of the same model),
ghost, bk and flash (flash needs GPUs). gloo on CPU, NCCL where every rank has a GPU. One JSON per run in `--out`:
mode, sequence length, batches, world size, peak memory, mean step time, the model config.

Peak memory of a run (model shard, optimizer state, gathered parameters, activations, gradients, flashdp's own
buffers): GPU, `max_memory_allocated` above what was held before the model was built; CPU, the peak resident set
size above the one before the model was built, sampled every 2 ms (freed heap is returned to the OS between
runs). `step_peak_mb`: the peak one more (untimed) step adds above what is allocated when it starts, from the
allocator itself (benchmarks/memory.py: the profiler's record on CPU, `max_memory_allocated` on GPU). Both are the
maximum over ranks.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager, suppress
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import flashdp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for benchmarks/
from benchmarks.memory import step_peak_mib

MODES = ("no_dp", "ghost", "bk", "flash")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="no_dp,ghost,bk", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--seq-lens", default="128,256,512", help="comma-separated sequence lengths")
    parser.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--wrapper", default="fsdp2", choices=["fsdp2", "fsdp1"])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("out/fsdp_llama"))
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    args.seq_lens = [int(s) for s in args.seq_lens.split(",")]
    return args


def model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=int(args.d_model * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=max(args.seq_lens),
    )


def sharded_model(config: LlamaConfig, wrapper: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    if wrapper == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        policy = ModuleWrapPolicy({LlamaDecoderLayer})
        return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=device, use_orig_params=True)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


class PeakMemory:
    """Peak memory above the level at `start()`, in MiB: the CUDA allocator's, or the process's RSS sampled."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = self.base = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device) / 2**20
            return
        self.base = self.peak = _rss_mb()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / 2**20 - self.base
        self._stop.set()
        self._thread.join()
        return self.peak - self.base

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_mb())


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _release_freed_memory() -> None:
    """Return freed heap to the OS, so one run's RSS does not hide the next one's (glibc only)."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextmanager
def _run_scope(device: torch.device):
    yield
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _release_freed_memory()


def one_run(mode: str, seq: int, args: argparse.Namespace, device: torch.device) -> dict:
    """Time `args.steps` steps of `mode` at sequence length `seq`; the result, the same on every rank."""
    world = dist.get_world_size()
    config = model_config(args)
    memory = PeakMemory(device)
    memory.start()
    model = sharded_model(config, args.wrapper, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    global_batch = args.batch * world
    engine = None
    if mode != "no_dp":
        engine = flashdp.make_private(
            model, mode=mode, max_grad_norm=1.0, noise_multiplier=1.0, optimizer=optimizer,
            expected_batch_size=global_batch, sample_rate=global_batch / 100_000,
        )  # fmt: skip
    generator = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, args.vocab, (args.batch, seq), generator=generator).to(device)

    def step() -> None:
        loss = flashdp.per_sample_lm_loss(model(input_ids=ids).logits, ids)
        if engine is None:
            loss.mean().backward()  # FSDP averages over ranks: the mean over the global batch
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.backward(loss)
            engine.step()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = memory.stop()
    step_peak = step_peak_mib(step, device.type)  # one more step, untimed: the profiler records allocations
    figures = torch.tensor([peak, statistics.mean(times), step_peak], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the slowest rank and the fullest one
    if engine is not None:
        engine.detach()
    return {
        "mode": mode,
        "seq_len": seq,
        "batch_per_rank": args.batch,
        "global_batch": global_batch,
        "world_size": world,
        "wrapper": args.wrapper,
        "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_memory_mb": round(float(figures[0]), 2),
        "step_peak_mb": round(float(figures[2]), 2),
        "mean_step_s": round(float(figures[1]), 5),
        "step_times_s": [round(t, 5) for t in times],
        "steps": args.steps,
        "date": date.today().isoformat(),
        "torch": torch.__version__,
        "config": {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                   "num_hidden_layers", "num_attention_heads")},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    rank0 = dist.get_rank() == 0
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for mode in args.modes:
            if mode == "flash" and not use_cuda:
                if rank0:
                    print("skipping flash: its Triton kernels need a GPU (on CPU only the slow interpreter runs)")
                continue
            for seq in args.seq_lens:
                with _run_scope(device):
                    result = one_run(mode, seq, args, device)
                if rank0:
                    path = args.out / f"{args.wrapper}_{mode}_T{seq}.json"
                    path.write_text(json.dumps(result, indent=2) + "\n")
                    print(
                        f"{mode:>6} T={seq:<5} {result['mean_step_s'] * 1000:8.1f} ms/step  "
                        f"peak +{result['peak_memory_mb']:7.1f} MiB  -> {path}",
                        flush=True,
                    )
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
