"""DDP: the EMA update over a process group equals one process updating on the concatenated batch,
whether the ranks hold equal or different numbers of rows (none too); k-means initialisation works
with a rank that holds no rows, and raises on every rank when rank 0 holds none.

CPU tier: gloo, two CPU processes. GPU tier: NCCL, one process per GPU, when two GPUs are present.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _inputs(device):
    from test_vq import make

    x, codes, *state = make(2 * 13, 40, 6, L=2, used=9, device="cpu")  # most codes dead: restarts everywhere
    return [t.to(device) for t in (x, codes, *state)]


def _update(x, codes, state, group, semantics, device):
    from sparsefuse import vq_ema_update

    restart = dict(restart_after_steps=2) if semantics == "active" else dict(threshold=1.5)
    vq_ema_update(x, codes, *state, decay=0.9, semantics=semantics, **restart,
                  generator=torch.Generator(device=device).manual_seed(11), process_group=group)


def _kmeans_rows(device):
    return torch.randn(23, 6, generator=torch.Generator().manual_seed(5)).to(device)


def _kmeans_on(x, group):
    from sparsefuse.vq.modules import _kmeans

    return _kmeans(x, 5, 3, cosine=False, precision="exact", generator=torch.Generator(device=x.device).manual_seed(3),
                   process_group=group)


def _worker(rank, port, backend, out_dir):
    sys.path.insert(0, os.path.dirname(__file__))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    for semantics, rows0 in CASES:
        x, codes, *state = _inputs(device)
        sl = slice(0, rows0) if rank == 0 else slice(rows0, x.shape[1])  # rank 0's rows first
        # every rank's own generator has the same seed; the op uses rank 0's key anyway
        _update(x[:, sl].contiguous(), codes[:, sl].contiguous(), state, dist.group.WORLD, semantics, device)
        torch.save([t.cpu() for t in state], os.path.join(out_dir, f"{semantics}-{rows0}-rank{rank}.pt"))
    # k-means initialisation: rank 1 without rows (rank 0's rows seed every centroid), then rank 0
    # without rows, where every rank must raise (one raising while the other waits would hang)
    x = _kmeans_rows(device)
    c, n = _kmeans_on(x if rank == 0 else x[:0], dist.group.WORLD)
    errors = []
    try:
        _kmeans_on(x if rank == 1 else x[:0], dist.group.WORLD)
    except ValueError as e:
        errors.append(str(e))
    torch.save([c.cpu(), n.cpu(), errors], os.path.join(out_dir, f"kmeans-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    from helpers import end_spawned_worker

    end_spawned_worker()


def _check(tmp_path, backend):
    """Every case of CASES in one process group (a spawn costs seconds, an update milliseconds)."""
    from helpers import assert_close, free_port

    mp.spawn(_worker, args=(free_port(), backend, str(tmp_path)), nprocs=WORLD, join=True)
    device = "cuda" if backend == "nccl" else "cpu"

    for semantics, rows0 in CASES:
        case = f"{semantics}, rank 0 with {rows0} of 26 rows"
        x, codes, *want = _inputs(device)
        _update(x, codes, want, None, semantics, device)
        ranks = [torch.load(tmp_path / f"{semantics}-{rows0}-rank{r}.pt") for r in range(WORLD)]
        for got in ranks:
            for name, a, b in zip(("codebook", "cluster_size", "embed_sum", "counters"), got, want):
                b = b.cpu()
                if a.is_floating_point():
                    assert_close(a, b, torch.float32, f"{case}: {name}")
                else:
                    assert torch.equal(a, b), f"{case}: {name}"
        for a, b in zip(*ranks):
            assert torch.equal(a, b), f"{case}: ranks disagree"
    want = _kmeans_on(_kmeans_rows(device), None)
    ranks = [torch.load(tmp_path / f"kmeans-rank{r}.pt") for r in range(WORLD)]
    for got in ranks:
        for name, a, b in zip(("centroids", "counts"), got, want):
            assert_close(a, b.cpu(), torch.float32, f"k-means with rank 1 empty: {name}")
        assert len(got[2]) == 1 and "rank 0 of process_group has no rows" in got[2][0], got[2]
    assert torch.equal(ranks[0][0], ranks[1][0]), "k-means: ranks disagree"


# (semantics, rows of rank 0 out of 26): equal halves; unequal (with each rank's own B taken as the
# global count, ranks picked different restart rows and the summed candidates mixed two rows or
# none); rank 0 empty (it found no dead code while rank 1 restarted some)
CASES = [("active", 13), ("laplace", 13), ("laplace", 5), ("active", 0)]


def test_ddp_gloo_matches_concatenated_batch(tmp_path):
    _check(tmp_path, "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ddp_nccl_matches_concatenated_batch(tmp_path):
    _check(tmp_path, "nccl")
