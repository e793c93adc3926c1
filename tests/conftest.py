import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton decides when a kernel is decorated whether it is interpreted, and
    # wide_tessera.kernels loads its kernels on first use, after this line: without a GPU
    # they run in Triton's interpreter, slowly but exactly enough to test them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .helpers import FAST


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _cache_of_its_own(tmp_path_factory):
    """The suite's dispatch table and caches are its own, not the user's: the optuna tests read
    and wrote ~/.cache/wide_tessera/dispatch.json, so a table the user had tuned changed what they
    did, and two test runs on one machine shared one table."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WIDE_TESSERA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        patch.delenv("WIDE_TESSERA_DISPATCH", raising=False)
        yield


@pytest.fixture(autouse=True)
def _runs_kept_apart(monkeypatch, tmp_path_factory):
    """The runs the measuring commands keep go to a folder of the test's own, not the checkout's."""
    monkeypatch.setenv("WIDE_TESSERA_RUNS", str(tmp_path_factory.mktemp("kept-runs")))


@pytest.fixture(autouse=True)
def _no_controls(monkeypatch):
    """Controls compile a loop at every point (about 0.3 s each on the CPU): the tests of
    controls ask for them; elsewhere a run leaves them out unless told."""
    from wide_tessera.measurement import settings

    monkeypatch.setattr(settings, "default_controls", lambda preset=None, device="cpu": False)


@pytest.fixture(autouse=True)
def _registry_restored():
    """Ops and strategies a test registers (directly, by --import, from a README example)
    leave with the test; those of test modules, registered when imported, stay."""
    from wide_tessera.ops import registry

    ops, outside = dict(registry.REGISTRY), {k: dict(v) for k, v in registry._OUTSIDE.items()}
    yield
    registry.REGISTRY.clear()
    registry.REGISTRY.update(ops)
    registry._OUTSIDE.clear()
    registry._OUTSIDE.update(outside)


@pytest.fixture
def fast_timing():
    return FAST


@pytest.fixture
def one_thread():
    """One torch thread for the test (a run then times by the measuring thread's CPU clock)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def saved_results(tmp_path_factory):
    """A real results file of two results: gemm at N=1,2, and an op with a wrong and a raising strategy.

    Few samples, so that loading it (which the fuzzer does a thousand times) stays fast.
    """
    from wide_tessera import TimingConfig, save_results
    from wide_tessera.ops import WideLinear
    from wide_tessera.sweep.runner import run

    from .helpers import SometimesWrongLinear

    timing = TimingConfig(warmup_s=0.0, budget_s=0.001, min_samples=3, max_samples=3, min_sample_s=1e-4)
    results = [
        run(WideLinear.benchmark_job("ci", n_values=[1, 2]), timing=timing, verbose=False),
        run(SometimesWrongLinear.benchmark_job("test", n_values=[2]), timing=timing, verbose=False),
    ]
    path = tmp_path_factory.mktemp("results") / "results.json"
    save_results(results, path)
    return path


@pytest.fixture(autouse=True)
def gradients_left_on():
    """Every test leaves gradients on: a run stopped by Ctrl-C once left its generator suspended
    inside no_grad, and 95 later tests failed in backward, far from the cause."""
    yield
    assert torch.is_grad_enabled(), "this test left torch's grad mode off for every test after it"
