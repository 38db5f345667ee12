"""The "intro to advanced features" tutorial (shared/seeds), every code cell run in order with
``opacus`` renamed ``dptorch``, asserting what the text says each cell shows.

The cells are the tutorial's code (indentation restored); the IPython ``Image`` cells are skipped.
"""

import math
import re

import pytest
import torch

CELL_1 = """
import torch
from torch import nn
from torch.utils.data import TensorDataset, DataLoader
import warnings
warnings.simplefilter("ignore")
class SampleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 2)
    def forward(self, x):
        x = self.fc1(x)
        x = self.fc2(x)
        return x
DATASET = TensorDataset(torch.randn(100, 16), torch.randint(0,2, (100,)))
"""

CELL_3 = """
from opacus import PrivacyEngine
privacy_engine = PrivacyEngine()
model = SampleNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(DATASET, batch_size=10)
print(
    f"Before make_private(). "
    f"Model:{type(model)}, Optimizer:{type(optimizer)}, DataLoader:{type(data_loader)}"
)
model, optimizer, data_loader = privacy_engine.make_private(
    module=model,
    optimizer=optimizer,
    data_loader=data_loader,
    max_grad_norm=1.0,
    noise_multiplier=1.0,
)
print("="*20)
print(
    f"After make_private(). "
    f"Model:{type(model)}, Optimizer:{type(optimizer)}, DataLoader:{type(data_loader)}"
)
"""

CELL_4 = """
model = SampleNet()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(DATASET, batch_size=10)
"""

CELL_5 = """
from opacus import GradSampleModule
model = GradSampleModule(model)
model
"""

CELL_6 = """
# take a fake training step
y = model(torch.randn(10, 16))
y.sum().backward()
# inspect gradient values
grad = model.fc1.weight.grad
grad_sample = model.fc1.weight.grad_sample
print("grad.shape: ", grad.shape)
print("grad_sample.shape: ", grad_sample.shape)
grad_sample_aggregated = grad_sample.mean(dim=0)
print("Average grad_sample over 1st dimension. Equal to original: ", torch.allclose(grad, grad_sample_aggregated))
model.zero_grad()
"""

CELL_7 = """
from opacus.privacy_engine import forbid_accumulation_hook
model.register_forward_pre_hook(forbid_accumulation_hook)
# first backward should work fine
model(torch.randn(10, 16)).sum().backward()
print("First backward successful")
# second should fail
model(torch.randn(10, 16)).sum().backward()
model.zero_grad()
"""

CELL_8 = """
from opacus.data_loader import DPDataLoader
dp_data_loader = DPDataLoader.from_data_loader(data_loader, distributed=False)
print("Is dataset the same: ", dp_data_loader.dataset == data_loader.dataset)
print(f"DPDataLoader length: {len(dp_data_loader)}, original: {len(data_loader)}")
print("DPDataLoader sampler: ", dp_data_loader.batch_sampler)
data_loader = dp_data_loader
"""

CELL_9 = """
batch_sizes = []
for x,y in dp_data_loader:
    batch_sizes.append(len(x))
print("Batch sizes sampled:", batch_sizes)
"""

CELL_10 = """
from opacus.optimizers import DPOptimizer
sample_rate = 1 / len(data_loader)
expected_batch_size = int(len(data_loader.dataset) * sample_rate)
optimizer = DPOptimizer(
    optimizer=optimizer,
    noise_multiplier=1.0,
    max_grad_norm=1.0,
    expected_batch_size=expected_batch_size,
)
"""

CELL_11 = """
from opacus.accountants import RDPAccountant
accountant = RDPAccountant()
optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
"""

CELL_13 = """
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch.distributions.laplace import Laplace
class LaplaceDPOptimizer(DPOptimizer):
    def add_noise(self):
        laplace = Laplace(loc=0, scale=self.noise_multiplier * self.max_grad_norm)
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = laplace.sample(p.summed_grad.shape)
            p.grad = p.summed_grad + noise
            _mark_as_processed(p.summed_grad)
"""


def _run(cell: str, ns: dict) -> None:
    exec(compile(re.sub(r"\bopacus\b", "dptorch", cell), "<tutorial>", "exec"), ns)


def test_tutorial_cells_run_and_behave_as_described(capsys):
    torch.manual_seed(0)
    ns: dict = {}
    _run(CELL_1, ns)

    _run(CELL_3, ns)
    import dptorch
    from dptorch.data_loader import DPDataLoader
    from dptorch.optimizers import DPOptimizer

    assert isinstance(ns["model"], dptorch.GradSampleModule)
    assert isinstance(ns["optimizer"], DPOptimizer)
    assert isinstance(ns["data_loader"], DPDataLoader)
    assert "After make_private()" in capsys.readouterr().out

    _run(CELL_4, ns)
    _run(CELL_5, ns)
    assert repr(ns["model"]).startswith("GradSampleModule(SampleNet(")

    _run(CELL_6, ns)
    out = capsys.readouterr().out
    assert "grad.shape:  torch.Size([8, 16])" in out
    assert "grad_sample.shape:  torch.Size([10, 8, 16])" in out
    assert "Equal to original:  True" in out

    # cell 7: the second backward raises the documented error
    with pytest.raises(ValueError, match="Poisson sampling is not compatible with grad accumulation"):
        _run(CELL_7, ns)
    assert "First backward successful" in capsys.readouterr().out
    ns["model"].zero_grad()

    _run(CELL_8, ns)
    out = capsys.readouterr().out
    assert "Is dataset the same:  True" in out
    assert "DPDataLoader length: 10, original: 10" in out
    assert "UniformWithReplacementSampler" in out

    _run(CELL_9, ns)
    sizes = ns["batch_sizes"]
    assert len(sizes) == 10 and all(0 <= s <= 100 for s in sizes)
    # Poisson: sizes vary around the expected batch size 10 (Binomial(100, 0.1))
    assert 0 < sum(sizes) < 300

    _run(CELL_10, ns)
    assert ns["expected_batch_size"] == 10
    _run(CELL_11, ns)

    # the objects are "ready to be used for training": one epoch, accounted step by step
    model, optimizer, accountant = ns["model"], ns["optimizer"], ns["accountant"]
    # the model still has the forbid_accumulation_hook of cell 7: stepping + zero_grad is fine
    for x, y in ns["data_loader"]:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert sum(n for _, _, n in accountant.history) == 10
    eps = accountant.get_epsilon(delta=1e-5)
    assert math.isfinite(eps) and eps > 0

    # cell 13: the Laplace subclass trains, and its noise is Laplace(σC)
    _run(CELL_13, ns)
    laplace_cls = ns["LaplaceDPOptimizer"]
    net = ns["SampleNet"]()
    lap = laplace_cls(
        torch.optim.SGD(net.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=10,
        loss_reduction="sum",
    )
    gsm = dptorch.GradSampleModule(net)
    before = [p.detach().clone() for p in net.parameters()]
    diffs = []
    for _ in range(40):
        x = torch.randn(10, 16)
        gsm(x).sum().backward()
        lap.step()
        clean = [p.summed_grad for p in lap.params]
        diffs.append(torch.cat([(p.grad - c).flatten() for p, c in zip(lap.params, clean)]))
        lap.zero_grad()
    assert any(not torch.equal(b, p) for b, p in zip(before, net.parameters()))
    noise = torch.cat(diffs)
    # Laplace(b=1): mean |X| = 1, var = 2 (n = 40 * 154 samples)
    assert abs(noise.abs().mean().item() - 1.0) < 0.05
    assert abs(noise.var().item() - 2.0) < 0.2
