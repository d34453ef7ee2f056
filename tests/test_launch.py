"""The shared low-overhead launcher (``sparsefuse._launch.launch``).

CPU tier: under the interpreter it is ``kernel[grid](...)``; the cached path runs against a stand-in
JIT function whose kernels remember Triton's specialisation of their arguments. GPU tier: a cached
launch must pick the kernel Triton would have picked (dtype, 16-byte alignment, integer
specialisation) and must still call a profiler's launch hooks when some are installed.
"""

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from helpers import DEVICE, run_without_interpreter
from sparsefuse._launch import launch


@triton.jit(do_not_specialize=["scale"])
def _axpb_kernel(x_ptr, y_ptr, n, scale, shift, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=0).to(tl.float32)
    tl.store(y_ptr + o, (x * scale + shift).to(y_ptr.dtype.element_ty), mask=m)


def _run(x, scale, shift):
    y = torch.empty_like(x)
    n = x.numel()
    launch(_axpb_kernel, (triton.cdiv(n, 64),), (x, y, n, scale, shift), dict(BLOCK=64), 4)
    return y


def _cases():
    base = torch.randn(300, device=DEVICE)
    # dtypes, a view that is not 16-byte aligned, n = 1 and n divisible by 16, an int scale
    # past 32 bits (a do_not_specialize parameter still changes type), float shifts
    return [(base, 3, 0.5), (base.to(torch.bfloat16), 3, 0.5), (base[1:], 2, -1.0), (base[:1], 1, 0.0),
            (base[:32], 2**33, 0.0), (base[3:200].double(), -2, 0.25)]


def test_launch_matches_the_reference_formula():
    for x, scale, shift in _cases():
        want = (x.double() * scale + shift).to(x.dtype)
        torch.testing.assert_close(_run(x, scale, shift), want, rtol=1e-2, atol=1e-2 * abs(scale))


@pytest.mark.gpu
def test_gpu_cached_launches_pick_the_right_specialisation():
    """Each case twice in alternation: the second round goes through the launcher's cache."""
    for _ in range(2):
        for x, scale, shift in _cases():
            want = (x.double() * scale + shift).to(x.dtype)
            torch.testing.assert_close(_run(x, scale, shift), want, rtol=1e-2, atol=1e-2 * abs(scale))


@pytest.mark.gpu
def test_gpu_cached_launch_calls_installed_hooks():
    x = torch.randn(100, device="cuda")
    _run(x, 2, 1.0)  # compiled and cached
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _run(x, 2, 1.0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    _run(x, 2, 1.0)
    torch.cuda.synchronize()
    assert seen == ["_axpb_kernel"]


@pytest.mark.gpu
def test_gpu_ops_run_on_the_device_of_their_tensors():
    """With device 0 current, ops on cuda:1 tensors run on cuda:1 and give, bit for bit, what they give
    with cuda:1 current: custom ops set no device guard and Triton launches on the current device, so
    the launcher switches to the tensors' device. The first run compiles (Triton's own launch path),
    later calls take the cached one; the search takes the autotuned path."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import sparsefuse

    def run(dev):
        g = torch.Generator(dev).manual_seed(0)
        idx = torch.randint(0, 1000, (64, 16), device=dev, generator=g)
        w = torch.randn(1000, 96, device=dev, generator=g).requires_grad_()
        v = torch.rand(64, 16, device=dev, generator=g).sort(1, descending=True).values.requires_grad_()
        b = torch.randn(96, device=dev, generator=g).requires_grad_()
        t = torch.randn(64, 96, device=dev, generator=g)
        out = []
        for loss_fn in (sparsefuse.topk_sae_loss, sparsefuse.hierarchical_sae_loss):
            loss = loss_fn(idx, w, v, b, t, deterministic=True)
            out += [loss, *torch.autograd.grad(loss, (w, v, b))]
        z = torch.randn(32, 500, device=dev, generator=g).requires_grad_()
        ids = torch.randint(0, 500, (32, 8), device=dev, generator=g)
        logprobs = torch.log_softmax(torch.randn(32, 8, device=dev, generator=g), -1)
        loss = sparsefuse.topk_kd_loss_from_logits(z, ids, logprobs)
        out += [loss, *torch.autograd.grad(loss, z)]
        x = torch.randn(300, 32, device=dev, generator=g)
        codebook = torch.randn(64, 32, device=dev, generator=g)
        codes, dist = sparsefuse.nearest_code(x, codebook)
        cluster_size, embed_sum = torch.ones(64, device=dev), codebook.clone()
        sparsefuse.vq_ema_update(x, codes, codebook, cluster_size, embed_sum, deterministic=True)
        return out + [codes, dist, codebook, cluster_size, embed_sum]

    with torch.cuda.device(0):
        got = run("cuda:1")
    with torch.cuda.device(1):
        want = run("cuda:1")
    torch.cuda.synchronize(1)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.device == torch.device("cuda:1"), i
        assert torch.equal(a, b), f"output {i} differs with device 0 current"

# --- the cached path on the CPU: a stand-in JIT function whose "compiled kernels" remember Triton's
# own specialisation of the arguments they were compiled for (triton's native_specialize_impl), so a
# cached launch that reuses a kernel compiled for different argument types is caught without a GPU.

from types import SimpleNamespace  # noqa: E402

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from sparsefuse import _launch  # noqa: E402


class _Ptr:
    """The first argument: launch() only asks it whether it is on CUDA, and on which device."""

    is_cuda = True

    def __init__(self, device=0):
        self.device = device

    def get_device(self):
        return self.device


class _FakeJIT:
    def __init__(self, names, nospec, n_constexpr):
        self.arg_names = list(names)
        self.params = [SimpleNamespace(do_not_specialize=n in nospec) for n in names]
        self.n_args = len(names) - n_constexpr
        self.launched = []  # (grid as launched, specialisation of the kernel, specialisation of the args)
        self.devices = []  # the current device at each launch

    def spec(self, all_args):
        out = []
        for i, (p, a) in enumerate(zip(self.params, all_args)):
            if isinstance(a, _Ptr):
                out.append("ptr")
            elif i >= self.n_args:
                out.append(("constexpr", a))
            else:
                out.append(native_specialize_impl(BaseBackend, a, False, not p.do_not_specialize, True))
        return tuple(out)

    def __getitem__(self, grid):
        fn = self

        class Kernel:
            function = packed_metadata = None

            def __init__(self, spec):
                self.spec = spec

            def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *all_args):
                fn.launched.append(((g0, g1, g2), self.spec, fn.spec(all_args)))
                fn.devices.append(torch.cuda.current_device())

        def run(*args, **meta):
            all_args = (*args, *(meta[n] for n in self.arg_names[len(args):]))
            kernel = Kernel(self.spec(all_args))
            kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, None, None, None,
                       None, None, None, *all_args)
            return kernel

        return run


@pytest.fixture
def fast_path(monkeypatch):
    """launch() as on a GPU: cache on, no interpreter, device 0, stream 0."""
    monkeypatch.setattr(_launch, "INTERPRET", False)
    monkeypatch.setattr(_launch, "FAST", True)
    monkeypatch.setattr(_launch, "_CACHE", {})
    monkeypatch.setattr(_launch, "_NOSPEC", {})
    monkeypatch.setattr(_launch, "_current_stream", lambda dev: 0)
    current = [0]

    class device:  # torch.cuda.device
        def __init__(self, idx):
            self.idx = idx

        def __enter__(self):
            self.prev, current[0] = current[0], self.idx

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)


def _launch_all(fn, calls, grid=(3,)):
    ptr = _Ptr()  # one object: the key of anything but a tensor, int, float, bool or None is the object
    for args in calls:
        _launch.launch(fn, grid, (ptr, *args), dict(BLOCK=64), 4)
    for launched_grid, kernel_spec, args_spec in fn.launched:
        assert kernel_spec == args_spec, f"a kernel compiled for {kernel_spec} was launched with {args_spec}"
    assert len(fn.launched) == len(calls)


def test_cached_launch_separates_i64_from_u64_integers(fast_path):
    """Triton types an integer i32, i64, or u64 (>= 2^63); a cached i64 kernel handed 2^63 + 16
    fails to pack it (OverflowError on a GPU)."""
    fn = _FakeJIT(["p", "n", "s", "BLOCK"], nospec={"s"}, n_constexpr=1)
    _launch_all(fn, [(2**40, 2**40), (2**63 + 16, 2**40), (2**40, 2**63 + 16), (2**40, 2**40)])


def test_cached_launch_do_not_specialize_arguments_keep_their_type(fast_path):
    """A do_not_specialize parameter is not specialised on its value, but Triton still types it: an
    int (i32), a float (fp32), a bool (u1) and None (constexpr) each need their own kernel; the key
    used to call all of the first three "fits in 32 bits" (an i32 kernel then got the float: a
    TypeError on a GPU) and crashed on None."""
    fn = _FakeJIT(["p", "n", "s", "BLOCK"], nospec={"s"}, n_constexpr=1)
    _launch_all(fn, [(8, 3), (8, 2.5), (8, True), (8, None), (8, 3), (8, 2.5)])


def test_cached_launch_keeps_the_third_grid_axis(fast_path):
    fn = _FakeJIT(["p", "n", "s", "BLOCK"], nospec={"s"}, n_constexpr=1)
    _launch_all(fn, [(8, 3), (8, 3)], grid=(2, 3, 4))
    assert [g for g, _, _ in fn.launched] == [(2, 3, 4), (2, 3, 4)]


def test_launch_keys_never_merge_arguments_that_triton_specialises_apart(fast_path):
    """Every pair of scalar arguments that share a launcher key gets the same Triton specialisation,
    for specialised and ``do_not_specialize`` parameters alike."""
    x = torch.zeros(8)
    values = [0, 1, 2, 16, 17, -1, -16, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**32, 2**63 - 1, 2**63, 2**63 + 16,
              2**64 - 1, 0.0, 1.0, 2.5, True, False, None, x, x[1:], x.double(), x.to(torch.bfloat16)]
    for nospec in (False, True):
        fn = _FakeJIT(["p", "a", "BLOCK"], nospec={"a"} if nospec else set(), n_constexpr=1)
        calls = [(v,) for v in values] + [(v,) for v in reversed(values)]
        _launch_all(fn, calls)


# --- the eager fast path (sparsefuse/_registry.py): anything but plain eager takes the registered op


def test_reference_path_of_ops_without_a_backward_records_no_graph():
    """Without TRITON_INTERPRET, CPU tensors take the PyTorch references; for an op without a
    backward they ran with grad mode on, so what they wrote took its inputs' graph, where the kernels
    write plain values. An x that requires grad (an encoder output passed undetached) made the VQ
    state non-leaf tensors holding x's graph, and the next update refused them ("codebook requires
    grad"); the batch statistics required grad; and removing the radial part of a Parameter's .grad
    turned that .grad into a tensor with a grad_fn."""
    code = r"""
import torch, sparsefuse, sparsefuse._registry as r
from sparsefuse.vq import batch_statistics
from sparsefuse.sae.ops import remove_parallel_component_
assert not r.INTERPRET
g = torch.Generator().manual_seed(0)
x = torch.randn(6, 4, generator=g).requires_grad_()
codes = torch.randint(0, 5, (6,), generator=g)
state = [torch.randn(5, 4, generator=g), torch.rand(5, generator=g) + 1, torch.randn(5, 4, generator=g)]
want = [t.clone() for t in state]
for _ in range(2):  # the second update refused the state the first left
    sparsefuse.vq_ema_update(x, codes, *state, decay=0.9)
    with torch.no_grad():
        sparsefuse.vq_ema_update(x, codes, *want, decay=0.9)
for a, b in zip(state, want):
    assert not a.requires_grad and a.grad_fn is None
    torch.testing.assert_close(a, b, rtol=0, atol=0)
assert not any(t.requires_grad for t in batch_statistics(x, codes, 5))
w = torch.nn.Parameter(torch.randn(5, 4, generator=g))
(w.sum() ** 2).backward()
want = w.grad.clone()
with torch.no_grad():
    remove_parallel_component_(want, w)
remove_parallel_component_(w.grad, w)
assert not w.grad.requires_grad and w.grad.grad_fn is None
torch.testing.assert_close(w.grad, want, rtol=0, atol=0)
print("ok")
"""
    run_without_interpreter(code)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:`torch.jit.trace` is deprecated")
def test_jit_trace_records_the_registered_op():
    """Under ``torch.jit.trace`` sizes are traced tensors and a Triton launch is invisible to the
    tracer: the fast path crashed under the interpreter (and would leave the op out of the graph on a
    GPU); the registered op is recorded as one node and replays with new inputs."""
    from sparsefuse import sae_decode

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 8, generator=g)
    idx = torch.randint(0, 16, (4, 3), generator=g)

    def decode(vals, idx):
        return sae_decode(idx, vals, weight)

    traced = torch.jit.trace(decode, (torch.randn(4, 3, generator=g), idx), check_trace=False)
    assert "sparsefuse::sae_decode" in str(traced.graph)
    vals = torch.randn(4, 3, generator=g)
    torch.testing.assert_close(traced(vals, idx), decode(vals, idx))


@pytest.mark.parametrize("fast", [True, False])
def test_launch_runs_on_the_device_of_the_tensors(fast_path, monkeypatch, fast):
    """Triton launches on the current device; tensors on another one failed there with Triton's
    "Pointer argument cannot be accessed from Triton (cpu tensor?)" (custom ops set no device guard),
    so launch() makes their device current for the launch."""
    monkeypatch.setattr(_launch, "FAST", fast)
    fn = _FakeJIT(["p", "n", "s", "BLOCK"], nospec={"s"}, n_constexpr=1)
    ptr = _Ptr(device=1)
    for _ in range(2):  # compiled, then cached
        _launch.launch(fn, (3,), (ptr, 8, 3), dict(BLOCK=64), 4)
    assert fn.devices == [1, 1] and torch.cuda.current_device() == 0


@pytest.mark.parametrize("fast", [True, False])
def test_launch_with_an_optional_first_tensor_passed_as_none(fast_path, monkeypatch, fast):
    """A kernel whose first pointer is optional (KD's reduction: no per-token terms) launches on the
    device of the first tensor given (it failed with AttributeError on None.is_cuda on a GPU)."""
    monkeypatch.setattr(_launch, "FAST", fast)
    fn = _FakeJIT(["p0", "p", "n", "BLOCK"], nospec=set(), n_constexpr=1)
    for _ in range(2):  # compiled, then cached
        _launch.launch(fn, (3,), (None, _Ptr(device=1), 8), dict(BLOCK=64), 4)
    assert fn.devices == [1, 1] and torch.cuda.current_device() == 0


def test_launch_tuned_runs_on_the_device_of_the_tensors(fast_path):
    fn = _FakeJIT(["p", "n", "s", "BLOCK"], nospec={"s"}, n_constexpr=1)
    tuned_on = []

    class Tuner:  # triton.autotune's Autotuner: tunes (here: picks) on the current device, then launches
        best_config = None

        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid_fn):
            def run(*args, **meta):
                tuned_on.append(torch.cuda.current_device())
                self.best_config = triton.Config(dict(BLOCK=64), num_warps=4, num_stages=2)
            return run

    tuner, ptr = Tuner(fn), _Ptr(device=1)
    for _ in range(2):  # tuned, then the pick launched through launch()
        _launch.launch_tuned(tuner, lambda meta: (3,), (ptr, 8, 3), {}, ("tuned", 1))
    assert tuned_on == [1] and fn.devices == [1] and torch.cuda.current_device() == 0


def test_launch_tuned_keeps_each_key_its_own_pick_when_threads_tune_at_once(fast_path, monkeypatch):
    """An autotuner keeps its pick in one attribute; two threads tuning different keys at once could
    each store the other's pick (found in a review; the lock in launch_tuned serialises tuning)."""
    import threading
    import time

    monkeypatch.setattr(_launch, "_TUNED", {})
    fn = _FakeJIT(["p", "n", "BLOCK"], nospec=set(), n_constexpr=1)

    class Tuner:  # one shared autotuner object, as triton.autotune makes
        best_config = None

        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid_fn):
            def run(p, n, **meta):
                self.best_config = triton.Config(dict(BLOCK=n), num_warps=4, num_stages=2)
                time.sleep(0.05)  # tuning takes a while; the other thread starts meanwhile
            return run

    tuner = Tuner(fn)
    threads = [threading.Thread(target=_launch.launch_tuned,
                                args=(tuner, lambda meta: (1,), (_Ptr(device=0), n), {}, ("race", n)))
               for n in (16, 32)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert {key[1]: cfg.kwargs["BLOCK"] for key, cfg in _launch._TUNED.items()} == {16: 16, 32: 32}


def test_segmented_sum_kernels_compile_for_sm90():
    """The interpreter (the CPU tier) never type-checks a kernel; scripts/compile_sm90.py compiles
    every variant of the segmented-sum kernels for an H100/H200 target on this machine (no GPU
    needed). Its first two catches were a helper returning fp32 in one constexpr branch and fp64 in
    the other, and a loop-carried variable that changed type: both passed every CPU test."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "compile_sm90.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kernel variants for sm_90" in out.stdout and "FAILED" not in out.stderr


# --- mutation audit: what else a cached kernel is compiled for, and launch hooks on the cached path


class _OptsJIT(_FakeJIT):
    """A stand-in whose kernels also remember the launch options they were compiled with (num_warps,
    num_stages: Triton compiles one kernel per pair) and record the hooks each launch was given."""

    def __getitem__(self, grid):
        fn = self

        class Kernel:
            function = packed_metadata = None

            def __init__(self, spec, opts):
                self.spec, self.opts = spec, opts

            def launch_metadata(self, grid, stream, *all_args):
                return "metadata"

            def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *all_args):
                fn.launched.append(((g0, g1, g2), self.spec, fn.spec(all_args)))
                fn.kernels.append(self)
                fn.hooks.append((meta, enter, leave))

        def run(*args, num_warps=None, num_stages=None, **meta):
            all_args = (*args, *(meta[n] for n in self.arg_names[len(args):]))
            kernel = Kernel(self.spec(all_args), (num_warps, num_stages))
            fn.launched.append((tuple(grid) + (1,) * (3 - len(grid)), kernel.spec, kernel.spec))
            fn.kernels.append(kernel)
            fn.hooks.append(None)
            return kernel

        return run

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.kernels, self.hooks = [], []


def test_cached_launch_keys_cover_constexprs_and_launch_options(fast_path):
    """A kernel compiled for BLOCK=64, or for 4 warps / 2 stages, is not reused for BLOCK=32, 8 warps
    or 3 stages (each is a different compiled kernel in Triton)."""
    fn = _OptsJIT(["p", "n", "BLOCK"], nospec=set(), n_constexpr=1)
    ptr = _Ptr()
    calls = [(64, 4, None), (32, 4, None), (64, 8, None), (64, 4, 3), (64, 8, 3), (32, 4, None), (64, 8, None)]
    for block, warps, stages in calls:
        _launch.launch(fn, (3,), (ptr, 8), dict(BLOCK=block), warps, stages)
    assert len(fn.kernels) == len(fn.launched) == len(calls)
    for (block, warps, stages), kernel, (_, kernel_spec, args_spec) in zip(calls, fn.kernels, fn.launched):
        assert kernel_spec == args_spec, f"a kernel compiled for {kernel_spec} was launched with {args_spec}"
        assert kernel.opts == (warps, stages), f"a kernel compiled with {kernel.opts} launched as {(warps, stages)}"
    assert all(h is not None for h in fn.hooks[5:]), "the last two calls should take the cached path"


@pytest.mark.parametrize("which", ["enter", "exit"])
def test_cached_launch_passes_installed_hooks_on_the_cpu(fast_path, which):
    """The CPU twin of test_gpu_cached_launch_calls_installed_hooks: a cached launch with only an
    exit hook (or only an enter hook) installed hands both hooks and the launch metadata to the
    kernel; with none installed it passes None for all three."""
    fn = _OptsJIT(["p", "n", "BLOCK"], nospec=set(), n_constexpr=1)
    ptr = _Ptr()
    _launch.launch(fn, (3,), (ptr, 8), dict(BLOCK=64), 4)  # compiled
    _launch.launch(fn, (3,), (ptr, 8), dict(BLOCK=64), 4)  # cached, no hooks
    assert fn.hooks[-1] == (None, None, None)
    chain = knobs.runtime.launch_enter_hook if which == "enter" else knobs.runtime.launch_exit_hook
    hook = lambda metadata: None  # noqa: E731
    chain.add(hook)
    try:
        _launch.launch(fn, (3,), (ptr, 8), dict(BLOCK=64), 4)
    finally:
        chain.remove(hook)
    meta, enter, leave = fn.hooks[-1]
    assert meta == "metadata" and enter is knobs.runtime.launch_enter_hook and leave is knobs.runtime.launch_exit_hook


# --- mutation audit: plain_eager's other refusals (a dispatch mode, a functorch transform, meta tensors)


def _decode_inputs():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 8, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 16, (4, 3), generator=g)
    vals = torch.randn(4, 3, generator=g, dtype=torch.float64)
    return idx, vals, weight


def test_dispatch_mode_sees_the_registered_ops():
    """Under a TorchDispatchMode (opcheck's SchemaCheckMode, FlopCounterMode, a logging mode) the op is
    dispatched, not launched behind the mode's back: a mutating op included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparsefuse import sae_decode
    from sparsefuse.sae.ops import normalize_rows_

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    idx, vals, weight = _decode_inputs()
    with Record() as mode:
        out = sae_decode(idx, vals, weight)
        normalize_rows_(weight.clone())
    assert "sparsefuse.sae_decode.default" in mode.seen and "sparsefuse.normalize_rows_.default" in mode.seen, mode.seen
    torch.testing.assert_close(out, torch.einsum("bk,bkd->bd", vals, weight[idx]))


def test_vmap_goes_through_the_registered_op():
    """Under torch.vmap the arguments are batched wrappers (plain ``torch.Tensor`` to ``type()``): the
    registered op runs them through PyTorch's batching fallback; the launcher, handed a wrapper,
    failed with "Cannot access storage of BatchedTensorImpl"."""
    from sparsefuse import sae_decode

    idx, vals, weight = _decode_inputs()
    batch = torch.stack([vals, 2 * vals, -vals])
    got = torch.vmap(lambda v: sae_decode(idx, v, weight))(batch)
    torch.testing.assert_close(got, torch.stack([sae_decode(idx, v, weight) for v in batch]))


def test_meta_tensors_take_the_fake_implementation():
    from sparsefuse import sae_decode

    idx, vals, weight = (t.to("meta") for t in _decode_inputs())
    out = sae_decode(idx, vals, weight)
    assert out.device.type == "meta" and out.shape == (4, 8) and out.dtype == torch.float64


@pytest.mark.parametrize("needs", ["vals", "weight", "bias"])
def test_fast_path_keeps_autograd_when_one_input_requires_grad(needs):
    """The eager fast path records the autograd Function when any (not every) input requires grad."""
    from sparsefuse import sae_decode

    idx, vals, weight = _decode_inputs()
    bias = torch.randn(8, dtype=torch.float64)
    inputs = dict(vals=vals, weight=weight, bias=bias)
    inputs[needs] = inputs[needs].clone().requires_grad_()
    out = sae_decode(idx, inputs["vals"], inputs["weight"], inputs["bias"])
    grad = torch.autograd.grad(out.square().sum(), inputs[needs])[0]
    ref = {k: v.detach().clone().requires_grad_(k == needs) for k, v in inputs.items()}
    want_out = torch.einsum("bk,bkd->bd", ref["vals"], ref["weight"][idx]) + ref["bias"]
    want = torch.autograd.grad(want_out.square().sum(), ref[needs])[0]
    torch.testing.assert_close(grad, want)


# --- forward-mode AD: refused, never a silent zero tangent


def _forward_ad_cases():
    import sparsefuse

    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64).to(DEVICE)
    idx = torch.randint(0, 6, (3, 2), generator=g).to(DEVICE)
    v = torch.randn(3, 2, generator=g, dtype=torch.float64).to(DEVICE)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64).to(DEVICE)
    return {  # name: (function of one tensor, the primal)
        "sae_decode": (lambda vv: sparsefuse.sae_decode(idx, vv, w), v),
        "topk_sae_loss": (lambda ww: sparsefuse.topk_sae_loss(idx, ww, v, None, x), w),
        "hierarchical_sae_loss": (lambda vv: sparsefuse.hierarchical_sae_loss(idx, w, vv, None, x), v),
        "sparse_linear": (lambda xx: sparsefuse.sparse_linear(xx, w, idx), x),
        "nearest_code": (lambda xx: sparsefuse.nearest_code(xx, w)[1], x),
    }


@pytest.mark.parametrize("op", ["sae_decode", "topk_sae_loss", "hierarchical_sae_loss", "sparse_linear", "nearest_code"])
def test_forward_mode_ad_is_refused(op):
    """torch.func.jvp used to return a zero tangent, and a dual tensor under forward_ad no tangent at
    all (the ops have no forward-mode formula); both now raise. A constant argument (no tangent, not
    wrapped) is still fine inside either."""
    import torch.autograd.forward_ad as fwAD

    fn, primal = _forward_ad_cases()[op]
    tangent = torch.randn_like(primal)
    match = "sparsefuse ops have no forward-mode AD formula"
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jvp(fn, (primal,), (tangent,))
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jacfwd(fn)(primal)
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match=match):
            fn(fwAD.make_dual(primal, tangent))
        want = fn(primal)  # no tangent anywhere: runs
    out, tan = torch.func.jvp(lambda p: p.sum() + fn(primal).sum(), (primal,), (tangent,))
    torch.testing.assert_close(out, primal.sum() + want.sum())
    torch.testing.assert_close(tan, tangent.sum())


def test_forward_mode_ad_runs_what_carries_no_tangent():
    """Inside torch.func.jvp, arguments derived from the primal without a tangent run: the VQ
    straight-through pattern (codes of the detached input) and integer ids chosen from the primal."""
    import sparsefuse

    g = torch.Generator().manual_seed(0)
    cb = torch.randn(6, 4, generator=g, dtype=torch.float64).to(DEVICE)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64).to(DEVICE)
    tangent = torch.randn(5, 4, generator=g, dtype=torch.float64).to(DEVICE)
    _, tan = torch.func.jvp(lambda xx: xx - cb[sparsefuse.nearest_code(xx.detach(), cb)[0]], (x,), (tangent,))
    torch.testing.assert_close(tan, tangent)
    v = torch.randn(5, 2, generator=g, dtype=torch.float64).to(DEVICE)
    s = torch.randn(5, 6, generator=g, dtype=torch.float64).to(DEVICE)
    fn = lambda ss: sparsefuse.sae_decode(ss.topk(2).indices, v, cb) + ss.sum()  # noqa: E731
    out, tan = torch.func.jvp(fn, (s,), (s,))
    torch.testing.assert_close(out, fn(s))
    torch.testing.assert_close(tan, s.sum().expand(5, 4))


# --- second derivatives and functorch's reverse mode: refused, never silently dropped


def _reverse_cases():
    """name: (scalar function of one tensor, the primal), one per autograd formula in the package."""
    import sparsefuse

    g = torch.Generator().manual_seed(1)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE)  # noqa: E731
    w, x, v, bias = r(6, 4), r(3, 4), r(3, 2), r(4)
    idx = torch.randint(0, 6, (3, 2), generator=g).to(DEVICE)
    codes = torch.randint(0, 6, (3,), generator=g).to(DEVICE)
    logits, hidden = r(3, 6), r(3, 4)
    t = torch.log_softmax(r(3, 2), -1)
    return {
        "sae_decode": (lambda ww: sparsefuse.sae_decode(idx, v, ww, bias).square().sum(), w),
        "topk_sae_loss": (lambda ww: sparsefuse.topk_sae_loss(idx, ww, v, bias, x), w),
        "hierarchical_sae_loss": (lambda ww: sparsefuse.hierarchical_sae_loss(idx, ww, v, bias, x), w),
        # deterministic: the loss and its unscaled gradients from one launch (a second registered op)
        "hierarchical_sae_loss fused": (
            lambda ww: sparsefuse.hierarchical_sae_loss(idx, ww, v, bias, x, deterministic=True), w),
        "sparse_linear": (lambda ww: sparsefuse.sparse_linear(x, ww, idx).square().sum(), w),
        "quantize": (lambda xx: sparsefuse.vq.quantize(xx, codes, w)[0].square().sum()
                     + sparsefuse.vq.quantize(xx, codes, w)[1], x),
        "nearest_code": (lambda xx: sparsefuse.nearest_code(xx, w, cosine=True)[1].square().sum(), x),
        "topk_kd_loss": (lambda z: sparsefuse.topk_kd_loss(z, t), r(3, 2)),
        "topk_kd_loss_from_logits": (lambda z: sparsefuse.topk_kd_loss_from_logits(z, idx, t), logits),
        "topk_kd_loss_from_hidden": (lambda ww: sparsefuse.topk_kd_loss_from_hidden(hidden, ww, idx, t), w),
    }


@pytest.mark.parametrize("op", list(_reverse_cases()))
def test_second_derivative_is_refused(op):
    """Under create_graph=True the kernels' gradients came back as constants: a gradient penalty or a
    Hessian-vector product built on them silently lost its second-order terms (on the CPU
    references, part of them). Now a backward with create_graph=True raises; without it, the
    gradient is what it was."""
    fn, primal = _reverse_cases()[op]
    match = "sparsefuse ops have no second derivative"
    p = primal.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match=match):
        torch.autograd.grad(fn(p), p, create_graph=True)
    with pytest.raises(NotImplementedError, match=match):
        fn(p).backward(create_graph=True)
    with pytest.raises(NotImplementedError, match=match):
        torch.autograd.functional.hvp(fn, primal, torch.ones_like(primal))
    (got,) = torch.autograd.grad(fn(p), p)  # the same graph, first order: runs
    q = primal.clone().requires_grad_()
    fn(q).backward()
    torch.testing.assert_close(got, q.grad)  # two runs: the default hierarchical path uses atomics on a GPU
    assert got.abs().sum() > 0


@pytest.mark.parametrize("op", list(_reverse_cases()))
def test_functorch_reverse_mode_is_refused(op):
    """torch.func.grad / vjp / jacrev failed inside PyTorch with a message about setup_context; they
    now raise one that says what to use instead. A call whose arguments the transform does not
    differentiate still runs inside it, and so does torch.vmap, except for the distillation losses,
    whose autograd.Function PyTorch refuses under any functorch transform: they say so."""
    fn, primal = _reverse_cases()[op]
    kd = op.startswith("topk_kd")
    match = "does not run under functorch transforms" if kd else "do not support functorch's reverse-mode"
    with pytest.raises(NotImplementedError, match=match):
        torch.func.grad(fn)(primal)
    with pytest.raises(NotImplementedError, match=match):
        torch.func.vjp(fn, primal)
    s = torch.tensor(3.0, dtype=torch.float64, device=DEVICE)
    batch = torch.stack([primal, 2 * primal])
    if kd:
        with pytest.raises(NotImplementedError, match=match):
            torch.func.grad(lambda ss: ss * fn(primal))(s)
        with pytest.raises(NotImplementedError, match=match):
            torch.vmap(fn)(batch)
    else:
        torch.testing.assert_close(torch.func.grad(lambda ss: ss * fn(primal))(s), fn(primal))
        # a captured parameter requires grad, but not at the transform's level: it runs too
        param = torch.nn.Parameter(primal.clone())
        torch.testing.assert_close(torch.func.grad(lambda ss: ss * fn(param))(s), fn(primal))
        torch.testing.assert_close(torch.vmap(fn)(batch), torch.stack([fn(primal), fn(2 * primal)]))
        # a vmap inside grad: the batched arguments do not require grad, which had let PyTorch's
        # setup_context message through
        with pytest.raises(NotImplementedError, match=match):
            torch.func.grad(lambda b: torch.vmap(fn)(b).sum())(batch)
        with pytest.raises(NotImplementedError, match=match):
            torch.func.vjp(torch.vmap(fn), batch)


@pytest.mark.parametrize("op", list(_reverse_cases()))
def test_batched_backward_is_refused(op):
    """A backward under torch.vmap (batched incoming gradients) failed deep inside PyTorch or the
    kernels ("Cannot access storage of BatchedTensorImpl", "Batching rule not implemented"); it now
    says what is not supported. One gradient at a time still runs."""
    fn, primal = _reverse_cases()[op]
    p = primal.clone().requires_grad_()
    out = fn(p)
    batched = torch.stack([torch.ones_like(out), 2 * torch.ones_like(out)])
    with pytest.raises(NotImplementedError, match="sparsefuse ops have no batched backward"):
        torch.autograd.grad(fn(p), p, batched, is_grads_batched=True)
    with pytest.raises(NotImplementedError, match="sparsefuse ops have no batched backward"):
        torch.autograd.functional.jacobian(lambda q: fn(q).reshape(1), primal, vectorize=True)
    (got,) = torch.autograd.grad(out, p)
    assert got.abs().sum() > 0


def test_ema_update_refuses_vmap():
    """vq_ema_update (and so a VQ module in training mode) under torch.vmap failed in the overlap
    check with "Cannot access storage of BatchedTensorImpl", and before that check in the dispatcher
    ("Batching rule not implemented"); it now says it does not run there. Searching (eval mode) runs."""
    from sparsefuse import VectorQuantizer, vq_ema_update

    g = torch.Generator().manual_seed(0)
    x, cb, es = (torch.randn(3, *s, generator=g).to(DEVICE) for s in ((6, 4), (5, 4), (5, 4)))
    codes, n = torch.randint(0, 5, (3, 6), generator=g).to(DEVICE), torch.rand(3, 5, generator=g).to(DEVICE)
    with pytest.raises(NotImplementedError, match="does not run under functorch transforms"):
        torch.vmap(lambda *a: vq_ema_update(*a, decay=0.9))(x, codes, cb, n, es)
    vq = VectorQuantizer(4, 5).to(DEVICE)
    with pytest.raises(NotImplementedError, match="does not run under functorch transforms"):
        torch.vmap(vq.train())(x)
    _, got, _ = torch.vmap(vq.eval())(x)
    assert torch.equal(got, torch.stack([vq(x[i])[1] for i in range(3)]))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("op", list(_reverse_cases()))
def test_activation_checkpointing_gives_the_same_gradients(op, reentrant):
    """torch.utils.checkpoint reruns the forward inside the backward (the reentrant form with grad mode
    on around it, then a nested backward): the ops must run there, and :func:`first_order` must not
    take that for a second derivative."""
    from torch.utils.checkpoint import checkpoint

    fn, primal = _reverse_cases()[op]
    p = primal.clone().requires_grad_()
    fn(p * 1.0).backward()
    q = primal.clone().requires_grad_()
    checkpoint(lambda qq: fn(qq * 1.0), q, use_reentrant=reentrant).backward()
    torch.testing.assert_close(q.grad, p.grad)  # not bit-exact: the default hierarchical path uses atomics on a GPU


# --- mutation audit (session 39): tensor subclasses, and a backward under the functorch vmap


def test_tensor_subclass_goes_through_the_registered_op():
    """A tensor subclass (here PyTorch's TwoTensor test wrapper, with its own __torch_dispatch__) is
    not a plain tensor: the op is dispatched, so the subclass sees it and runs it on each of its
    parts. Launched directly, the kernels would be handed a wrapper without storage of its own."""
    from torch.testing._internal.two_tensor import TwoTensor

    from sparsefuse import sae_decode

    idx, vals, weight = _decode_inputs()
    out = sae_decode(idx, TwoTensor(vals, 2 * vals), weight)
    assert isinstance(out, TwoTensor)
    want = torch.einsum("bk,bkd->bd", vals, weight[idx])
    torch.testing.assert_close(out.a, want)
    torch.testing.assert_close(out.b, 2 * want)


@pytest.mark.parametrize("op", list(_reverse_cases()))
def test_backward_under_functorch_vmap_is_refused(op):
    """The per-sample-gradient pattern ``torch.vmap(lambda g: torch.autograd.grad(out, p, g))`` runs
    the backward under functorch's vmap (batched incoming gradients that are not the legacy batched
    tensors of is_grads_batched=True): refused with the same message, not a failure in the kernels."""
    fn, primal = _reverse_cases()[op]
    p = primal.clone().requires_grad_()
    out = fn(p)
    batch = torch.stack([torch.ones_like(out), 2 * torch.ones_like(out)])
    with pytest.raises(NotImplementedError, match="sparsefuse ops have no batched backward"):
        torch.vmap(lambda g: torch.autograd.grad(out, p, g, retain_graph=True)[0])(batch)


# Rare paths the session 52 mutation pass found untested (benchmarks/logs/mutation_session52_launch_harness.md).

# --- the cached launcher ---------------------------------------------------------------------


def _compiled(fn):
    """Per launch of an ``_OptsJIT``: True where it compiled (went through ``fn[grid]``)."""
    return [h is None for h in fn.hooks]


def test_cached_launch_keeps_apart_pointers_aligned_to_8_but_not_16_bytes(fast_path):
    """Triton specialises a pointer on 16-byte alignment; a kernel compiled for an aligned pointer
    and reused for one 8 bytes past it would issue misaligned vector loads on a GPU."""
    x = torch.zeros(16)
    d = torch.zeros(16, dtype=torch.float64)
    fn = _FakeJIT(["p", "a", "BLOCK"], nospec=set(), n_constexpr=1)
    _launch_all(fn, [(x,), (x[2:],), (x,), (x[2:],), (d,), (d[1:],), (d[2:],), (d[1:],)])


def test_cached_launch_reuses_its_kernel_for_new_values_of_one_specialisation(fast_path):
    """One kernel for every value of a ``do_not_specialize`` integer and for values of a specialised
    one that Triton types alike (3, 5, 1001; two floats): a key on the value would compile per
    batch size (and grow the cache without bound)."""
    fn = _OptsJIT(["p", "n", "s", "BLOCK"], nospec={"s"}, n_constexpr=1)
    ptr = _Ptr()
    for n, s in ((3, 5), (5, 7), (1001, 2**20 + 3), (7, 16), (3, 1)):
        _launch.launch(fn, (3,), (ptr, n, s), dict(BLOCK=64), 4)
    for eps in (0.5, 2.5, 1e-6):
        _launch.launch(fn, (3,), (ptr, 3, eps), dict(BLOCK=64), 4)
    assert _compiled(fn) == [True, False, False, False, False, True, False, False]
    for _, kernel_spec, args_spec in fn.launched:
        assert kernel_spec == args_spec


def test_cached_launch_compiles_once_per_device(fast_path):
    """A kernel loaded on device 0 is not launched on device 1 (its module lives in device 0's
    context): each device gets its own cache entry."""
    fn = _OptsJIT(["p", "n", "BLOCK"], nospec=set(), n_constexpr=1)
    ptr = _Ptr()  # one object (a non-tensor object's key is the object), moved between devices
    for dev in (0, 1, 1, 0):
        ptr.device = dev
        _launch.launch(fn, (3,), (ptr, 8), dict(BLOCK=64), 4)
    assert _compiled(fn) == [True, True, False, False]
    assert fn.kernels[2] is fn.kernels[1] and fn.kernels[3] is fn.kernels[0]


def test_cached_launch_passes_constexprs_in_the_signature_order(fast_path):
    """``meta`` given in another order than the kernel's signature: the cached launch hands the
    constexprs over by name, as ``JITFunction.run`` binds them."""
    fn = _FakeJIT(["p", "n", "BLOCK_A", "BLOCK_B"], nospec=set(), n_constexpr=2)
    ptr = _Ptr()
    for _ in range(2):  # compiled, then cached
        _launch.launch(fn, (3,), (ptr, 8), dict(BLOCK_B=32, BLOCK_A=64), 4)
    assert len(fn.launched) == 2
    for _, kernel_spec, args_spec in fn.launched:
        assert kernel_spec == args_spec
        assert args_spec[2:] == (("constexpr", 64), ("constexpr", 32))


def test_cached_launch_of_a_two_dimensional_grid(fast_path):
    fn = _FakeJIT(["p", "n", "s", "BLOCK"], nospec={"s"}, n_constexpr=1)
    _launch_all(fn, [(8, 3), (8, 3), (8, 3)], grid=(2, 3))
    assert [g for g, _, _ in fn.launched] == [(2, 3, 1)] * 3


def test_cached_launch_calls_a_hook_assigned_as_a_plain_function(fast_path, monkeypatch):
    """``knobs.runtime.launch_enter_hook = f`` (a function, not a HookChain with ``calls``) is a hook
    too: the cached launch passes it with the launch metadata, as Triton's own launch would."""
    fn = _OptsJIT(["p", "n", "BLOCK"], nospec=set(), n_constexpr=1)
    ptr = _Ptr()
    _launch.launch(fn, (3,), (ptr, 8), dict(BLOCK=64), 4)  # compiled
    hook = lambda metadata: None  # noqa: E731
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    _launch.launch(fn, (3,), (ptr, 8), dict(BLOCK=64), 4)
    meta, enter, _ = fn.hooks[-1]
    assert meta == "metadata" and enter is hook


def test_tuned_launch_uses_the_picks_grid_warps_and_stages(fast_path, monkeypatch):
    """After tuning, launch_tuned launches the autotuner's pick itself: the grid computed from the
    pick's block size, and the pick's num_warps and num_stages (another pair is another kernel)."""
    monkeypatch.setattr(_launch, "_TUNED", {})
    fn = _OptsJIT(["p", "n", "BLOCK"], nospec=set(), n_constexpr=1)

    class Tuner:
        best_config = None

        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid_fn):
            def run(*args, **meta):
                self.best_config = triton.Config(dict(BLOCK=32), num_warps=8, num_stages=3)
            return run

    tuner, ptr = Tuner(fn), _Ptr()
    for _ in range(3):  # tuned, then compiled through launch(), then cached
        _launch.launch_tuned(tuner, lambda meta: (_launch.cdiv(100, meta["BLOCK"]),), (ptr, 100), {}, ("t", 100))
    assert _compiled(fn) == [True, False]
    assert [g for g, _, _ in fn.launched] == [(4, 1, 1)] * 2
    assert fn.kernels[0].opts == (8, 3)
    assert fn.launched[0][1][2] == ("constexpr", 32)


def test_cdiv_and_next_pow2_at_their_edges():
    assert [_launch.cdiv(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    ns = (-3, 0, 1, 2, 3, 4, 5, 64, 65, 2**31)
    assert [_launch.next_pow2(n) for n in ns] == [1, 1, 1, 2, 4, 4, 8, 64, 128, 2**31]


