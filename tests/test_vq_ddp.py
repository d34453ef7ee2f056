"""DDP: the EMA update over a process group equals one process updating on the concatenated batch.

CPU tier: gloo, two CPU processes. GPU tier: NCCL, one process per GPU, when two GPUs are present.
"""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(device):
    from test_vq import make

    x, codes, *state = make(2 * 13, 40, 6, L=2, used=9, device="cpu")  # most codes dead: restarts everywhere
    return [t.to(device) for t in (x, codes, *state)]


def _update(x, codes, state, group, semantics, device):
    from sparsefuse import vq_ema_update

    vq_ema_update(x, codes, *state, decay=0.9, semantics=semantics, threshold=1.5, restart_after_steps=2,
                  generator=torch.Generator(device=device).manual_seed(11), process_group=group)


def _worker(rank, port, backend, out_dir, semantics):
    sys.path.insert(0, os.path.dirname(__file__))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    x, codes, *state = _inputs(device)
    B = x.shape[1] // WORLD
    sl = slice(rank * B, (rank + 1) * B)
    # every rank's own generator has the same seed; the op broadcasts rank 0's key anyway
    _update(x[:, sl].contiguous(), codes[:, sl].contiguous(), state, dist.group.WORLD, semantics, device)
    torch.save([t.cpu() for t in state], os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    from helpers import end_spawned_worker

    end_spawned_worker()


def _check(tmp_path, backend, semantics):
    mp.spawn(_worker, args=(_free_port(), backend, str(tmp_path), semantics), nprocs=WORLD, join=True)
    device = "cuda" if backend == "nccl" else "cpu"
    x, codes, *want = _inputs(device)
    _update(x, codes, want, None, semantics, device)
    from helpers import assert_close

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for got in ranks:
        for name, a, b in zip(("codebook", "cluster_size", "embed_sum", "counters"), got, want):
            b = b.cpu()
            if a.is_floating_point():
                assert_close(a, b, torch.float32, name)
            else:
                assert torch.equal(a, b), name
    for a, b in zip(*ranks):
        assert torch.equal(a, b), "ranks disagree"


@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_ddp_gloo_matches_concatenated_batch(tmp_path, semantics):
    _check(tmp_path, "gloo", semantics)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("semantics", ["active", "laplace"])
def test_ddp_nccl_matches_concatenated_batch(tmp_path, semantics):
    _check(tmp_path, "nccl", semantics)
