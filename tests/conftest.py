import pytest
import torch

from wide_tessera import TimingConfig

# Timing is not under test in most tests: sample briefly so the suite stays fast.
FAST = TimingConfig(warmup_s=0.0, budget_s=0.005, min_samples=3, min_sample_s=1e-4)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture
def fast_timing():
    return FAST
