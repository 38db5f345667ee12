"""DP-trained DCGAN on scikit-learn's 8x8 digits (offline, CPU, a couple of minutes).

The discriminator D is private: it sees the real digits, is wrapped by
``PrivacyEngine.make_private(..., multi_pass=True)`` and takes one DP step per real batch, with
two backward passes (real, generated). The generator G never sees real data: it is updated
through D with D's hooks off, so its training is post-processing of D's private releases.

``--clipping basic`` (``accum_passes=True``): each real sample's gradient is summed with the
gradient of the generated sample of the same index, then clipped once; noise ``σ·C``. Sound
because the generated batch has exactly ``len(real_batch)`` fresh i.i.d. latents (see
docs/multi_pass.md).

``--clipping split`` (``accum_passes=False, num_private_passes=1``): each pass is clipped on its
own; only the real pass is private. The generated pass uses a *fixed* number of latents (the
expected batch size), so neither its samples nor their number depend on the private data (G and
D are public at the start of the step); noise ``σ·C·1``. Tying that number to the real batch
size would make the generated pass private too (``num_private_passes=2``).

Run: ``python examples/dcgan.py --clipping split --epochs 3 --out samples.png``;
``--steps 3`` stops after three discriminator steps (smoke test).
"""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import nullcontext

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine

logger = logging.getLogger("dcgan")

NZ = 16  # latent size


class Generator(nn.Module):
    """z (NZ) -> 1x8x8 image in [-1, 1]."""

    def __init__(self, nz: int = NZ, width: int = 64):
        super().__init__()
        self.width = width
        self.fc = nn.Sequential(nn.Linear(nz, width * 2 * 2 * 2), nn.ReLU())
        self.net = nn.Sequential(
            nn.ConvTranspose2d(width * 2, width, 4, 2, 1),  # 2x2 -> 4x4
            nn.BatchNorm2d(width),  # fine here: G is not trained on private data
            nn.ReLU(),
            nn.ConvTranspose2d(width, 1, 4, 2, 1),  # 4x4 -> 8x8
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(self.fc(z).view(-1, self.width * 2, 2, 2))


class Discriminator(nn.Module):
    """1x8x8 image -> logit. No BatchNorm (it mixes samples): GroupNorm instead."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 4, 2, 1),  # 8x8 -> 4x4
            nn.LeakyReLU(0.2),
            nn.Conv2d(width, width * 2, 4, 2, 1),  # 4x4 -> 2x2
            nn.GroupNorm(8, width * 2),
            nn.LeakyReLU(0.2),
            nn.Flatten(),
            nn.Linear(width * 2 * 2 * 2, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).view(-1)


def load_digits_tensor() -> torch.Tensor:
    """The 1797 scikit-learn digits as (N, 1, 8, 8) float32 in [-1, 1]."""
    from sklearn.datasets import load_digits

    x = load_digits().images.astype(np.float32) / 16.0 * 2.0 - 1.0
    return torch.from_numpy(x).unsqueeze(1)


def save_grid(images: torch.Tensor, path: str, nrow: int = 8) -> None:
    """Saves (N, 1, 8, 8) images in [-1, 1] as a PNG grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    imgs = ((images.detach().cpu().clamp(-1, 1) + 1) / 2).squeeze(1).numpy()
    ncol = -(-len(imgs) // nrow)
    fig, axes = plt.subplots(ncol, nrow, figsize=(nrow, ncol))
    for ax, i in zip(np.ravel(axes), range(ncol * nrow)):
        ax.axis("off")
        if i < len(imgs):
            ax.imshow(imgs[i], cmap="gray", vmin=0, vmax=1)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clipping", choices=["basic", "split"], default="split")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="stop after this many D steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--sigma", type=float, default=1.0, help="noise multiplier")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--grad-sample-mode", choices=["hooks", "functorch"], default="hooks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="samples.png")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    """Trains and returns the final epsilon."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    data = load_digits_tensor()
    loader = DataLoader(TensorDataset(data), batch_size=args.batch_size, shuffle=True)
    netD, netG = Discriminator(), Generator()
    optD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(0.5, 0.999))
    mode = (
        {"accum_passes": True}
        if args.clipping == "basic"
        else {"accum_passes": False, "num_private_passes": 1}
    )
    engine = PrivacyEngine(accountant="rdp")
    netD, optD, loader = engine.make_private(
        module=netD,
        optimizer=optD,
        data_loader=loader,
        noise_multiplier=args.sigma,
        max_grad_norm=args.max_grad_norm,
        grad_sample_mode=args.grad_sample_mode,
        multi_pass=True,
        **mode,
    )
    expected_batch = optD.expected_batch_size
    bce = nn.BCEWithLogitsLoss()
    fixed_z = torch.randn(32, NZ)
    steps = 0
    eps = 0.0
    for epoch in range(1, args.epochs + 1):
        for (real,) in loader:
            n_real = real.shape[0]
            # ---- discriminator: one DP step, two backward passes (real, generated)
            optD.zero_grad()
            n_fake = n_real if args.clipping == "basic" else expected_batch
            with torch.no_grad():
                fake = netG(torch.randn(n_fake, NZ))
            loss_d = torch.zeros(())
            if n_real > 0:  # an empty Poisson batch still takes a (noise-only) step
                loss_real = bce(netD(real), torch.ones(n_real))
                loss_real.backward()
                loss_d = loss_d + loss_real.detach()
            if n_fake > 0:
                # split: n_fake is fixed and the latents are fresh noise, so this pass does not
                # depend on the private data: declare it public (basic pairs it with the real one)
                public = netD.public_pass() if args.clipping == "split" else nullcontext()
                with public:
                    loss_fake = bce(netD(fake), torch.zeros(n_fake))
                    loss_fake.backward()
                loss_d = loss_d + loss_fake.detach()
            optD.step()
            # ---- generator: through D, with D recording nothing
            optG.zero_grad()
            netD.disable_hooks()
            loss_g = bce(netD(netG(torch.randn(expected_batch, NZ))), torch.ones(expected_batch))
            loss_g.backward()
            netD.enable_hooks()
            optG.step()
            optD.zero_grad()  # drops D's non-private gradients from the generator pass
            steps += 1
            if args.steps is not None and steps >= args.steps:
                break
        eps = engine.get_epsilon(args.delta)
        logger.info(
            "epoch %d  step %d  loss_D %.3f  loss_G %.3f  epsilon %.3f (delta=%g)",
            epoch,
            steps,
            loss_d.item(),
            loss_g.item(),
            eps,
            args.delta,
        )
        if args.steps is not None and steps >= args.steps:
            break
    netG.eval()
    with torch.no_grad():
        save_grid(netG(fixed_z), args.out)
    logger.info("saved %s", args.out)
    return eps


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    main()
