"""Code written for Opacus 1.6 behaves the same under dptorch: each snippet below runs once with
``opacus`` and once with ``dptorch`` (same text, ``lib`` names the package), each library in a
subprocess of its own; Opacus comes from ``.opacus-env``, a separate environment that
``scripts/opacus_env.sh`` (run by the test command) installs. The outcomes must agree: the same
result, or the same exception type with dptorch's message containing Opacus's text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPACUS_ENV = ROOT / ".opacus-env"

PRELUDE = """
import importlib, json, sys, warnings
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
warnings.simplefilter("ignore")
lib = sys.argv[1]
def L(name):
    return importlib.import_module(lib + name)
def data(n=40, d=4):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, 2, (n,), generator=g))
def engine_and(model, optimizer, **kw):
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("max_grad_norm", 1.0)
    engine = L("").PrivacyEngine()
    return engine, engine.make_private(module=model, optimizer=optimizer,
                                       data_loader=DataLoader(data(), batch_size=10), **kw)
"""

#: name -> snippet body; it sets ``result`` (JSON-serialisable)
SNIPPETS: dict[str, str] = {
    "zero_grad_keeps_attribute": """
        torch.manual_seed(0)
        net = nn.Linear(4, 2)
        _, (model, opt, loader) = engine_and(net, torch.optim.SGD(net.parameters(), lr=0.1))
        x, y = next(iter(loader))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        result = [p.grad_sample is None for p in model.parameters()]
    """,
    "foreign_optimizer_parameters": """
        net, other = nn.Linear(4, 2), nn.Linear(4, 2)
        engine_and(net, torch.optim.SGD(other.parameters(), lr=0.1))
    """,
    "eval_mode_model": """
        net = nn.Linear(4, 2).eval()
        engine_and(net, torch.optim.SGD(net.parameters(), lr=0.1))
    """,
    "validate_eval_mode": """
        errors = L(".validators").ModuleValidator.validate(nn.Linear(4, 2).eval())
        result = [type(e).__name__ for e in errors]
    """,
    "fix_instance_norm_and_recurrent": """
        MV = L(".validators").ModuleValidator
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True, track_running_stats=True))
        fixed = MV.fix(m)
        inorm = fixed[1]
        result = {
            "instance_norm": [type(inorm).__name__, inorm.affine, inorm.track_running_stats],
            "lstm": type(MV.fix(nn.LSTM(4, 5, batch_first=True))).__name__,
            "gru": type(MV.fix(nn.GRU(4, 5, num_layers=2))).__name__,
            "mha": type(MV.fix(nn.MultiheadAttention(8, 2))).__name__,
            "valid": MV.is_valid(fixed),
        }
    """,
    "empty_poisson_batch_keeps_structure": """
        g = torch.Generator().manual_seed(0)
        ds = TensorDataset(torch.randn(30, 3, 4, dtype=torch.float64, generator=g),
                           torch.randint(0, 2, (30,), generator=g))
        DPDataLoader = L(".data_loader").DPDataLoader
        loader = DPDataLoader.from_data_loader(DataLoader(ds, batch_size=10))
        loader.batch_sampler.sample_rate = 1e-12
        result = [[list(t.shape), str(t.dtype)] for t in next(iter(loader))]
    """,
    "ignore_index_per_sequence_loss": """
        FGC = L(".utils.fast_gradient_clipping_utils").DPLossFastGradientClipping
        torch.manual_seed(0)
        net = nn.Linear(4, 5)
        _, (model, opt, criterion, loader) = engine_and(
            net, torch.optim.SGD(net.parameters(), lr=0.1), grad_sample_mode="ghost",
            criterion=nn.CrossEntropyLoss(ignore_index=-100))
        g = torch.Generator().manual_seed(1)  # the libraries use the global RNG differently
        logits = model(torch.randn(3, 6, 4, generator=g))
        target = torch.randint(0, 5, (3, 6), generator=g)
        target[0, 2:] = -100
        target[2, :5] = -100
        loss = criterion(logits.reshape(-1, 5), target.reshape(-1), shape=(3, 6, 5))
        result = [round(float(v), 6) for v in loss.loss_per_sample]
    """,
    "adaclip_bounds": """
        net = nn.Linear(4, 2)
        engine_and(net, torch.optim.SGD(net.parameters(), lr=0.1), clipping="adaptive",
                   target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=1.0,
                   min_clipbound=2.0, unclipped_num_std=5.0)
    """,
    "adaclip_noise_vs_count_std": """
        net = nn.Linear(4, 2)
        engine_and(net, torch.optim.SGD(net.parameters(), lr=0.1), clipping="adaptive",
                   target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
                   min_clipbound=0.1, unclipped_num_std=0.4)
    """,
    "per_sample_gradients_utils": """
        U = L(".utils.per_sample_gradients_utils")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        g = torch.Generator().manual_seed(2)
        x = torch.randn(6, 4, dtype=torch.float64, generator=g)
        micro = U.compute_microbatch_grad_sample(x, model, loss_reduction="mean")
        ref, got = U.compute_grad_samples_microbatch_and_opacus(x, model, loss_reduction="sum")
        packed = torch.nn.utils.rnn.pack_sequence(
            [torch.randn(n, 2, generator=g) for n in (3, 5, 2)], enforce_sorted=False)
        result = {
            "microbatch": {k: [round(v, 8) for v in t.flatten().tolist()] for k, t in micro.items()},
            "sum_close": {k: bool(torch.allclose(ref[k], got[k])) for k in ref},
            "check": [U.check_per_sample_gradients_are_correct(x, model, grad_sample_mode=m)
                      for m in U.get_grad_sample_modes(use_ew=True)],
            "modes": U.get_grad_sample_modes(use_ew=True),
            "loss": round(float(U.ModelWithLoss(model, "sum")(x)), 8),
            "unpacked": [t.shape[0] for t in U.unpack_packedsequences(packed)],
            "empty": [U.is_batch_empty(torch.zeros(0, 3)), U.is_batch_empty([torch.ones(2)])],
        }
    """,
    "checkpoint_keys": """
        import io
        torch.manual_seed(0)
        net = nn.Linear(4, 2)
        engine, (model, opt, loader) = engine_and(net, torch.optim.SGD(net.parameters(), lr=0.1))
        buf = io.BytesIO()
        engine.save_checkpoint(path=buf, module=model, optimizer=opt)
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=False)
        result = sorted(k for k in ckpt if k in ("module_state_dict", "privacy_accountant_state_dict",
                                                  "optimizer_state_dict"))
    """,
}


def _runner_source() -> str:
    parts = [PRELUDE, "out = {}"]
    for name, body in SNIPPETS.items():
        parts.append(
            f"def _snippet_{name}():\n"
            + textwrap.indent(textwrap.dedent(body).strip() + "\nreturn locals().get('result')", "    ")
            + f"\ntry:\n    out[{name!r}] = {{'result': _snippet_{name}()}}\n"
            f"except Exception as e:\n    out[{name!r}] = {{'error': type(e).__name__, 'message': str(e)}}\n"
        )
    parts.append("print('RESULT' + json.dumps(out))")
    return "\n".join(parts)


def _run(lib: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if lib == "opacus":
        env["PYTHONPATH"] = str(OPACUS_ENV)
    proc = subprocess.run(
        [sys.executable, "-c", _runner_source(), lib], capture_output=True, text=True, env=env,
        cwd=ROOT, timeout=300,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, f"{lib} runner failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT"):])


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    if not (OPACUS_ENV / "opacus" / "__init__.py").exists():
        pytest.skip("Opacus 1.6 is not installed in .opacus-env (run scripts/opacus_env.sh)")
    return {"opacus": _run("opacus"), "dptorch": _run("dptorch")}


#: where Opacus's message is more than the text users match (Opacus prints the list of errors)
MESSAGE_TEXT = {
    "eval_mode_model": "Model needs to be in training mode",
    "adaclip_noise_vs_count_std": "noise_multiplier must be smaller than 2 * unclipped_num_std",
}


@pytest.mark.parametrize("name", list(SNIPPETS))
def test_same_outcome_as_opacus(outcomes, name):
    want, got = outcomes["opacus"][name], outcomes["dptorch"][name]
    if "error" in want:
        text = MESSAGE_TEXT.get(name, want["message"])
        assert text in want["message"]
        assert got.get("error") == want["error"], (want, got)
        assert text in got["message"], (want, got)
    else:
        assert got == want, (want, got)


def test_runner_sees_a_difference():
    """The harness itself: the same snippet under two libraries that differ gives different
    outcomes (here the package name), so agreement above is not an artefact of the runner."""
    src = PRELUDE + "\nprint('RESULT' + json.dumps(lib))"
    outs = [
        subprocess.run([sys.executable, "-c", src, lib], capture_output=True, text=True, cwd=ROOT).stdout
        for lib in ("opacus", "dptorch")
    ]
    assert outs[0] != outs[1]


CHECKPOINT_SCRIPT = PRELUDE + """
mode, path = sys.argv[2], sys.argv[3]
torch.manual_seed(0)
net = nn.Linear(4, 2)
engine = L("").PrivacyEngine(accountant="rdp")
model, opt, loader = engine.make_private(
    module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
    data_loader=DataLoader(data(), batch_size=10), noise_multiplier=1.0, max_grad_norm=1.0)
noise = L(".schedulers").ExponentialNoise(opt, gamma=0.9)
if mode == "save":
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    noise.step()
    engine.save_checkpoint(path=path, module=model, optimizer=opt, noise_scheduler=noise)
else:
    engine.load_checkpoint(path=path, module=model, optimizer=opt, noise_scheduler=noise)
state = {k: v.tolist() for k, v in model.state_dict().items()}
momentum = [s["momentum_buffer"].tolist() for s in opt.original_optimizer.state.values()]
print("RESULT" + json.dumps([engine.get_epsilon(1e-5), state, momentum, noise.state_dict()]))
"""


@pytest.mark.parametrize("saver,loader", [("opacus", "dptorch"), ("dptorch", "opacus")])
def test_checkpoints_cross_load(saver, loader, tmp_path):
    """A checkpoint written by one library restores model, optimizer state (momentum), the
    accountant (the same epsilon) and the noise scheduler in the other: a run can migrate."""
    if not (OPACUS_ENV / "opacus" / "__init__.py").exists():
        pytest.skip("Opacus 1.6 is not installed in .opacus-env (run scripts/opacus_env.sh)")
    path = str(tmp_path / "ckpt.pt")
    out = []
    for lib, mode in ((saver, "save"), (loader, "load")):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if lib == "opacus":
            env["PYTHONPATH"] = str(OPACUS_ENV)
        proc = subprocess.run([sys.executable, "-c", CHECKPOINT_SCRIPT, lib, mode, path],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
        assert line is not None, proc.stderr[-4000:]
        out.append(json.loads(line[len("RESULT"):]))
    saved, loaded = out
    assert loaded[0] == pytest.approx(saved[0], rel=1e-9) and saved[0] > 0
    assert loaded[1:] == saved[1:]
